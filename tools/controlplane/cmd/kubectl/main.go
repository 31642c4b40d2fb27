// Command kubectl is the upstream kubectl, built from k8s.io/kubectl.
package main

import (
	"os"
	"strings"

	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	"k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"

	_ "k8s.io/client-go/plugin/pkg/client/auth" // client auth plugins, as upstream
)

// logVerbosity is the value of -v/--v among the arguments before "--" ("0" when not given).
// kubectl parses its flags only after the command is built, too late for what that logs; read
// here rather than with kubectl's own helper, which older releases (1.32) do not have.
func logVerbosity(args []string) string {
	for i := 0; i < len(args); i++ {
		arg := args[i]
		switch {
		case arg == "--":
			return "0"
		case arg == "-v" || arg == "--v":
			if i+1 < len(args) {
				return args[i+1]
			}
		case strings.HasPrefix(arg, "-v=") || strings.HasPrefix(arg, "--v="):
			if value := arg[strings.IndexByte(arg, '=')+1:]; value != "" {
				return value
			}
		}
	}
	return "0"
}

func main() {
	_, _ = logs.GlogSetter(logVerbosity(os.Args))
	if err := cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()); err != nil {
		util.CheckErr(err)
	}
}
