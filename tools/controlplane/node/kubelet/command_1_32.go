//go:build k8s_1_32

package main

import (
	"github.com/spf13/cobra"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

// 1.32's kubelet makes its own context (build.sh --node 1.32 sets the tag k8s_1_32).
func newKubeletCommand() *cobra.Command {
	return app.NewKubeletCommand()
}
