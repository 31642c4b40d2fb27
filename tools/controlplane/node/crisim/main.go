// Command crisim is the simulated container runtime of a simulated node: k8s.io/cri-client's
// in-memory fake runtime and image services served on a unix socket for one kubelet.
//
// It runs nothing. It records every RunPodSandbox and CreateContainer (the pod, the container's
// command, env, mounts and CDI devices) and every container exit as one JSON object per line in
// the --record file, which tests read. A container runs until kubelet stops it, except one whose
// command line is exactly `sleep N` or `sh -c "sleep N; exit K"` (also /bin/sh, bash): it exits by
// itself after N seconds with code 0 or K, so Jobs complete.
//
// Given --gpus N and --device-plugin-dir (kubelet's device-plugins folder), it also advertises N
// nvidia.com/gpu to kubelet through the device-plugin API (gpus.go).
//
// Given --cdi-spec-dir, it refuses to create a container whose CDI devices no spec there (*.json)
// defines, as containerd and CRI-O do ("unresolvable CDI devices").
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	kubeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
	"k8s.io/cri-client/pkg/util"
)

// The fake services keep a log of every call; it is cleared this often so a long run stays small.
const callLogReset = time.Minute

var (
	shellExit = regexp.MustCompile(`^\s*sleep\s+(\d+(?:\.\d+)?)\s*;\s*exit\s+(\d{1,3})\s*$`)
	seconds   = regexp.MustCompile(`^\d+(?:\.\d+)?$`) // not "infinity", "1e9", "-1"
	shells    = map[string]bool{"sh": true, "bash": true}
)

// exitRule reads the exit rule from a container's command line: after how long it exits by
// itself and with which code; ok is false for a container that runs until stopped.
func exitRule(argv []string) (after time.Duration, code int32, ok bool) {
	duration := ""
	exit := "0"
	switch {
	case len(argv) == 2 && filepath.Base(argv[0]) == "sleep" && seconds.MatchString(argv[1]):
		duration = argv[1]
	case len(argv) == 3 && shells[filepath.Base(argv[0])] && argv[1] == "-c":
		m := shellExit.FindStringSubmatch(argv[2])
		if m == nil {
			return 0, 0, false
		}
		duration, exit = m[1], m[2]
	default:
		return 0, 0, false
	}
	s, err := strconv.ParseFloat(duration, 64)
	if err != nil || s > 1e9 { // beyond ~30 years: as good as forever, and no Duration overflow
		return 0, 0, false
	}
	k, err := strconv.Atoi(exit)
	if err != nil || k > 255 {
		return 0, 0, false
	}
	return time.Duration(s * float64(time.Second)), int32(k), true
}

type podRef struct {
	Name      string `json:"name"`
	Namespace string `json:"namespace"`
	UID       string `json:"uid"`
}

type mountRecord struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Readonly      bool   `json:"readonly"`
}

// container is what CreateContainer asked for.
type container struct {
	Name       string            `json:"name"`
	Image      string            `json:"image"`
	Command    []string          `json:"command"` // command then args
	Env        map[string]string `json:"env"`
	Mounts     []mountRecord     `json:"mounts"`
	CDIDevices []string          `json:"cdi_devices"`
}

// record is one line of the record file.
type record struct {
	Time        string     `json:"time"`
	Op          string     `json:"op"` // RunPodSandbox, CreateContainer, ContainerExited
	Pod         podRef     `json:"pod"`
	SandboxID   string     `json:"sandbox_id"`
	ContainerID string     `json:"container_id,omitempty"`
	Container   *container `json:"container,omitempty"` // CreateContainer
	ExitCode    *int32     `json:"exit_code,omitempty"` // ContainerExited
}

// recorder appends records to a file, one JSON object per line, each in a single write.
type recorder struct {
	mu   sync.Mutex
	file *os.File
}

func (r *recorder) write(rec record) {
	rec.Time = time.Now().UTC().Format(time.RFC3339Nano)
	line, err := json.Marshal(rec)
	if err != nil {
		fmt.Fprintf(os.Stderr, "crisim: cannot encode a record: %v\n", err)
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.file.Write(append(line, '\n')); err != nil {
		fmt.Fprintf(os.Stderr, "crisim: cannot write the record: %v\n", err)
	}
}

// cdiSpec is the part of a CDI spec that names devices.
type cdiSpec struct {
	Kind    string `json:"kind"`
	Devices []struct {
		Name string `json:"name"`
	} `json:"devices"`
}

// unresolvableCDIDevices returns the devices of `names` that no JSON spec in `dir` defines.
func unresolvableCDIDevices(dir string, names []string) ([]string, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	defined := map[string]bool{}
	for _, file := range files {
		data, err := os.ReadFile(file)
		if os.IsNotExist(err) {
			continue // removed since the listing
		}
		if err != nil {
			return nil, err
		}
		var spec cdiSpec
		if err := json.Unmarshal(data, &spec); err != nil {
			return nil, fmt.Errorf("CDI spec %s: %w", file, err)
		}
		for _, d := range spec.Devices {
			defined[spec.Kind+"="+d.Name] = true
		}
	}
	var missing []string
	for _, name := range names {
		if !defined[name] {
			missing = append(missing, name)
		}
	}
	sort.Strings(missing)
	return missing, nil
}

// runtime is the fake runtime with recording and self-exiting containers on top.
type runtime struct {
	*fake.RemoteRuntime
	rec    *recorder
	cdiDir string // "" when CDI devices are not checked

	mu      sync.Mutex
	timers  map[string]*time.Timer // container id -> its pending exit
	pods    map[string]podRef      // sandbox id -> pod
	created map[string]record      // container id -> its CreateContainer record
}

func podOf(meta *kubeapi.PodSandboxMetadata) podRef {
	return podRef{Name: meta.GetName(), Namespace: meta.GetNamespace(), UID: meta.GetUid()}
}

func (r *runtime) RunPodSandbox(ctx context.Context, req *kubeapi.RunPodSandboxRequest) (*kubeapi.RunPodSandboxResponse, error) {
	resp, err := r.RemoteRuntime.RunPodSandbox(ctx, req)
	if err != nil {
		return nil, err
	}
	pod := podOf(req.GetConfig().GetMetadata())
	r.mu.Lock()
	r.pods[resp.PodSandboxId] = pod
	r.mu.Unlock()
	r.rec.write(record{Op: "RunPodSandbox", Pod: pod, SandboxID: resp.PodSandboxId})
	return resp, nil
}

func (r *runtime) CreateContainer(ctx context.Context, req *kubeapi.CreateContainerRequest) (*kubeapi.CreateContainerResponse, error) {
	if r.cdiDir != "" && len(req.GetConfig().GetCDIDevices()) > 0 {
		var names []string
		for _, d := range req.GetConfig().GetCDIDevices() {
			names = append(names, d.GetName())
		}
		missing, err := unresolvableCDIDevices(r.cdiDir, names)
		if err != nil {
			return nil, fmt.Errorf("failed to inject CDI devices: %w", err)
		}
		if len(missing) > 0 {
			return nil, fmt.Errorf("failed to inject CDI devices: unresolvable CDI devices %s", strings.Join(missing, ", "))
		}
	}
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	cfg := req.GetConfig()
	// Report where the container logs, as containerd does: kubelet cleans a removed container's
	// logs by globbing "<log path>*", which with an empty path removes every file in its cwd.
	svc := r.RuntimeService
	svc.Lock()
	if fc, ok := svc.Containers[resp.ContainerId]; ok {
		fc.LogPath = filepath.Join(req.GetSandboxConfig().GetLogDirectory(), cfg.GetLogPath())
	}
	svc.Unlock()
	c := &container{
		Name:       cfg.GetMetadata().GetName(),
		Image:      cfg.GetImage().GetImage(),
		Command:    append(append([]string{}, cfg.GetCommand()...), cfg.GetArgs()...),
		Env:        map[string]string{},
		Mounts:     []mountRecord{},
		CDIDevices: []string{},
	}
	rec := record{
		Op:          "CreateContainer",
		Pod:         podOf(req.GetSandboxConfig().GetMetadata()),
		SandboxID:   req.PodSandboxId,
		ContainerID: resp.ContainerId,
		Container:   c,
	}
	for _, kv := range cfg.GetEnvs() {
		c.Env[kv.GetKey()] = string(kv.GetValue()) // bytes from 1.37 on, a string before
	}
	for _, m := range cfg.GetMounts() {
		c.Mounts = append(c.Mounts, mountRecord{ContainerPath: m.GetContainerPath(), HostPath: m.GetHostPath(), Readonly: m.GetReadonly()})
	}
	for _, d := range cfg.GetCDIDevices() {
		c.CDIDevices = append(c.CDIDevices, d.GetName())
	}
	r.mu.Lock()
	r.created[resp.ContainerId] = rec
	r.mu.Unlock()
	r.rec.write(rec)
	return resp, nil
}

func (r *runtime) StartContainer(ctx context.Context, req *kubeapi.StartContainerRequest) (*kubeapi.StartContainerResponse, error) {
	resp, err := r.RemoteRuntime.StartContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	created, found := r.created[req.ContainerId]
	r.mu.Unlock()
	if !found {
		return resp, nil
	}
	if after, code, ok := exitRule(created.Container.Command); ok {
		id := req.ContainerId
		r.mu.Lock()
		r.timers[id] = time.AfterFunc(after, func() { r.exit(id, created.SandboxID, code) })
		r.mu.Unlock()
	}
	return resp, nil
}

// exit moves a running container to exited with `code`, as if its process had ended.
func (r *runtime) exit(id, sandbox string, code int32) {
	r.mu.Lock()
	delete(r.timers, id)
	pod := r.pods[sandbox]
	r.mu.Unlock()
	svc := r.RuntimeService
	svc.Lock()
	c, found := svc.Containers[id]
	if found && c.State == kubeapi.ContainerState_CONTAINER_RUNNING {
		c.State = kubeapi.ContainerState_CONTAINER_EXITED
		c.FinishedAt = time.Now().UnixNano()
		c.ExitCode = code
		c.Reason = "Completed"
		if code != 0 {
			c.Reason = "Error"
		}
	} else {
		found = false
	}
	svc.Unlock()
	if found {
		r.rec.write(record{Op: "ContainerExited", Pod: pod, SandboxID: sandbox, ContainerID: id, ExitCode: &code})
	}
}

func (r *runtime) StopContainer(ctx context.Context, req *kubeapi.StopContainerRequest) (*kubeapi.StopContainerResponse, error) {
	r.cancelExit(req.ContainerId)
	return r.RemoteRuntime.StopContainer(ctx, req)
}

func (r *runtime) RemoveContainer(ctx context.Context, req *kubeapi.RemoveContainerRequest) (*kubeapi.RemoveContainerResponse, error) {
	r.cancelExit(req.ContainerId)
	r.mu.Lock()
	delete(r.created, req.ContainerId)
	r.mu.Unlock()
	return r.RemoteRuntime.RemoveContainer(ctx, req)
}

func (r *runtime) RemovePodSandbox(ctx context.Context, req *kubeapi.RemovePodSandboxRequest) (*kubeapi.RemovePodSandboxResponse, error) {
	resp, err := r.RemoteRuntime.RemovePodSandbox(ctx, req)
	if err == nil {
		r.mu.Lock()
		delete(r.pods, req.PodSandboxId)
		r.mu.Unlock()
	}
	return resp, err
}

func (r *runtime) cancelExit(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if t, ok := r.timers[id]; ok {
		t.Stop()
		delete(r.timers, id)
	}
}

func main() {
	endpoint := flag.String("listen", "", "the unix socket to serve the CRI on, e.g. unix:///run/crisim.sock")
	recordPath := flag.String("record", "", "the file to append the record to (JSON lines)")
	cdiDir := flag.String("cdi-spec-dir", "", "refuse containers whose CDI devices no JSON spec in this folder defines")
	gpus := flag.Int("gpus", 0, "how many nvidia.com/gpu to advertise to kubelet (needs --device-plugin-dir)")
	devicePluginDir := flag.String("device-plugin-dir", "", "kubelet's device-plugins folder, where it serves kubelet.sock")
	imageSize := flag.Uint64("image-size", 64<<20, "the size in bytes every image reports (kubelet rejects size 0)")
	flag.Parse()
	if *endpoint == "" || *recordPath == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: crisim --listen unix:///path/to.sock --record path/to/record.jsonl [--cdi-spec-dir DIR] [--gpus N --device-plugin-dir DIR] [--image-size N]")
		os.Exit(2)
	}
	if *gpus < 0 || (*gpus > 0) != (*devicePluginDir != "") {
		fmt.Fprintln(os.Stderr, "crisim: --gpus N (N > 0) and --device-plugin-dir go together")
		os.Exit(2)
	}
	file, err := os.OpenFile(*recordPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fmt.Fprintf(os.Stderr, "crisim: cannot open the record file: %v\n", err)
		os.Exit(1)
	}
	fakeRuntime := fake.NewFakeRemoteRuntime()
	fakeRuntime.ImageService.SetFakeImageSize(*imageSize)
	svc := fakeRuntime.RuntimeService
	svc.Lock()
	svc.FakeStatus = &kubeapi.RuntimeStatus{Conditions: []*kubeapi.RuntimeCondition{
		{Type: kubeapi.RuntimeReady, Status: true},
		{Type: kubeapi.NetworkReady, Status: true},
	}}
	svc.FakeLinuxConfiguration = &kubeapi.LinuxRuntimeConfiguration{CgroupDriver: kubeapi.CgroupDriver_CGROUPFS}
	svc.Unlock()
	rt := &runtime{
		RemoteRuntime: fakeRuntime,
		rec:           &recorder{file: file},
		cdiDir:        *cdiDir,
		timers:        map[string]*time.Timer{},
		pods:          map[string]podRef{},
		created:       map[string]record{},
	}

	listener, err := util.CreateListener(*endpoint)
	if err != nil {
		fmt.Fprintf(os.Stderr, "crisim: %v\n", err)
		os.Exit(1)
	}
	server := grpc.NewServer()
	kubeapi.RegisterRuntimeServiceServer(server, rt)
	kubeapi.RegisterImageServiceServer(server, rt)

	go func() {
		for range time.Tick(callLogReset) {
			svc.Lock()
			svc.Called = nil
			svc.Unlock()
			images := fakeRuntime.ImageService
			images.Lock()
			images.Called = nil
			images.Unlock()
		}
	}()
	if *gpus > 0 {
		go (&gpuPlugin{dir: *devicePluginDir, resource: "nvidia.com/gpu", count: *gpus}).serve()
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		server.Stop()
	}()
	fmt.Fprintf(os.Stderr, "crisim: serving on %s, recording to %s\n", *endpoint, *recordPath)
	if err := server.Serve(listener); err != nil {
		fmt.Fprintf(os.Stderr, "crisim: %v\n", err)
		os.Exit(1)
	}
}
