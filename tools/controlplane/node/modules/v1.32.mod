// What the node binaries (node/kubelet, node/crisim) of Kubernetes 1.32 need on top of
// versions/v1.32.mod: tools/controlplane/build.sh --node 1.32 appends this to it (and v1.32.sum
// to versions/v1.32.sum). 1.32's kubelet has no k8s.io/cri-streaming yet.

require (
	github.com/Microsoft/hnslib v0.1.1 // indirect
	github.com/armon/circbuf v0.0.0-20190214190532-5111143e8da2 // indirect
	github.com/pmezard/go-difflib v1.0.1-0.20181226105442-5d4384ee4fb2 // indirect
	github.com/stretchr/objx v0.5.2 // indirect
	github.com/stretchr/testify v1.9.0 // indirect
	go.opentelemetry.io/contrib/instrumentation/github.com/emicklei/go-restful/otelrestful v0.42.0 // indirect
)
