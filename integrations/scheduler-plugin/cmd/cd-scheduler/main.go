// Command cd-scheduler is the upstream kube-scheduler of the pinned release with the
// ComputeDomainPlacement plugin compiled in, the way out-of-tree plugins are built. Deployed as a
// second scheduler with its own schedulerName, it leaves the cluster's default scheduler alone.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"

	"computedomains/integrations/scheduler-plugin/placement"
)

func main() {
	command := app.NewSchedulerCommand(app.WithPlugin(placement.Name, placement.New))
	os.Exit(cli.Run(command))
}
