// Command cdi-check loads CDI spec directories with the CDI project's own Go
// package (tags.cncf.io/container-device-interface/pkg/cdi, version pinned in
// go.mod), as container runtimes do: strict parsing, spec validation, and
// device injection into an empty OCI spec. It prints one JSON object:
//
//	{"errors": {path: [msg...]}, "devices": [qualified name...],
//	 "injected": {qualified name: OCI spec after injecting that device alone}}
//
// Usage: cdi-check <spec dir>...
package main

import (
	"encoding/json"
	"fmt"
	"os"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

type result struct {
	Errors   map[string][]string  `json:"errors"`
	Devices  []string             `json:"devices"`
	Injected map[string]*oci.Spec `json:"injected"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cdi-check <spec dir>...")
		os.Exit(2)
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(os.Args[1:]...), cdi.WithAutoRefresh(false))
	res := result{Errors: map[string][]string{}, Injected: map[string]*oci.Spec{}}
	if err != nil {
		// NewCache also returns the refresh errors; they are listed below by path.
		res.Errors[""] = []string{err.Error()}
	}
	for path, errs := range cache.GetErrors() {
		for _, e := range errs {
			res.Errors[path] = append(res.Errors[path], e.Error())
		}
	}
	res.Devices = cache.ListDevices()
	for _, device := range res.Devices {
		spec := &oci.Spec{}
		if _, err := cache.InjectDevices(spec, device); err != nil {
			res.Errors[device] = append(res.Errors[device], err.Error())
			continue
		}
		res.Injected[device] = spec
	}
	if res.Devices == nil {
		res.Devices = []string{}
	}
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", " ")
	if err := out.Encode(res); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
