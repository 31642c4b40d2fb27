//go:build !k8s_1_32

package main

import (
	"context"

	"github.com/spf13/cobra"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

func newKubeletCommand() *cobra.Command {
	return app.NewKubeletCommand(context.Background())
}
