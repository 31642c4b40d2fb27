// Command kube-apiserver is the upstream kube-apiserver, built from k8s.io/kubernetes.
package main

import (
	"os"
	_ "time/tzdata" // for CronJob time zone support, as upstream

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	os.Exit(cli.Run(app.NewAPIServerCommand()))
}
