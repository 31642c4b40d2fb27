// What the node binaries (node/kubelet, node/crisim) need on top of go.mod, the control plane's
// module set: tools/controlplane/build.sh --node appends this to go.mod (and v1.37.sum to
// go.sum) so the control plane's own module files, and so its cached build, stay as they are.

require (
	github.com/Microsoft/hnslib v0.1.3 // indirect
	github.com/stretchr/testify v1.11.1 // indirect
	go.opentelemetry.io/contrib/instrumentation/github.com/emicklei/go-restful/otelrestful v0.69.0 // indirect
	gopkg.in/yaml.v3 v3.0.1 // indirect
	k8s.io/cri-streaming v0.0.0 // indirect
)

// k8s.io/kubernetes points k8s.io/cri-streaming at its ./staging copy, as it does the others.
replace k8s.io/cri-streaming => k8s.io/cri-streaming v0.37.2
