// Command kubelet is the upstream kubelet, built from k8s.io/kubernetes with the control plane's
// module set; each simulated node runs one against crisim.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
)

func main() {
	os.Exit(cli.Run(newKubeletCommand()))
}
