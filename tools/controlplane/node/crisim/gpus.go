package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	deviceplugin "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// How often the GPU plugin checks that kubelet's registration socket is the one it registered
// with: kubelet removes every plugin socket when it starts, and a plugin registers again.
const kubeletSocketPoll = time.Second

// gpuPlugin advertises the node's GPUs to kubelet as the extended resource nvidia.com/gpu through
// the device-plugin API, as NVIDIA's device plugin does; allocating them injects nothing, since
// the simulated GPUs are no devices.
type gpuPlugin struct {
	deviceplugin.UnimplementedDevicePluginServer
	dir      string // kubelet's device-plugins folder
	resource string
	count    int
}

func (p *gpuPlugin) endpoint() string { return "crisim-gpus.sock" }

func (p *gpuPlugin) GetDevicePluginOptions(context.Context, *deviceplugin.Empty) (*deviceplugin.DevicePluginOptions, error) {
	return &deviceplugin.DevicePluginOptions{}, nil
}

func (p *gpuPlugin) ListAndWatch(_ *deviceplugin.Empty, stream deviceplugin.DevicePlugin_ListAndWatchServer) error {
	devices := make([]*deviceplugin.Device, p.count)
	for i := range devices {
		devices[i] = &deviceplugin.Device{ID: fmt.Sprintf("gpu-%d", i), Health: deviceplugin.Healthy}
	}
	if err := stream.Send(&deviceplugin.ListAndWatchResponse{Devices: devices}); err != nil {
		return err
	}
	<-stream.Context().Done() // the GPUs never change
	return nil
}

func (p *gpuPlugin) Allocate(_ context.Context, req *deviceplugin.AllocateRequest) (*deviceplugin.AllocateResponse, error) {
	resp := &deviceplugin.AllocateResponse{}
	for range req.ContainerRequests {
		resp.ContainerResponses = append(resp.ContainerResponses, &deviceplugin.ContainerAllocateResponse{})
	}
	return resp, nil
}

func (p *gpuPlugin) PreStartContainer(context.Context, *deviceplugin.PreStartContainerRequest) (*deviceplugin.PreStartContainerResponse, error) {
	return &deviceplugin.PreStartContainerResponse{}, nil
}

func inode(path string) uint64 {
	info, err := os.Stat(path)
	if err != nil {
		return 0
	}
	if st, ok := info.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}

// serve listens on the plugin's socket and registers with kubelet, again whenever kubelet's
// registration socket is a new one (kubelet restarted); it never returns.
func (p *gpuPlugin) serve() {
	kubeletSocket := filepath.Join(p.dir, "kubelet.sock")
	registered := uint64(0)
	var server *grpc.Server
	for range time.Tick(kubeletSocketPoll) {
		current := inode(kubeletSocket)
		if current == 0 || current == registered {
			continue
		}
		if server != nil {
			server.Stop()
		}
		var err error
		server, err = p.listen()
		if err == nil {
			err = p.register(kubeletSocket)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "crisim: GPU plugin: %v (retrying)\n", err)
			continue
		}
		registered = current
		fmt.Fprintf(os.Stderr, "crisim: GPU plugin registered %d %s with kubelet\n", p.count, p.resource)
	}
}

func (p *gpuPlugin) listen() (*grpc.Server, error) {
	path := filepath.Join(p.dir, p.endpoint())
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	listener, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer()
	deviceplugin.RegisterDevicePluginServer(server, p)
	go server.Serve(listener)
	return server, nil
}

func (p *gpuPlugin) register(kubeletSocket string) error {
	conn, err := grpc.NewClient("unix://"+kubeletSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = deviceplugin.NewRegistrationClient(conn).Register(ctx, &deviceplugin.RegisterRequest{
		Version:      deviceplugin.Version,
		Endpoint:     p.endpoint(),
		ResourceName: p.resource,
		Options:      &deviceplugin.DevicePluginOptions{},
	})
	return err
}
