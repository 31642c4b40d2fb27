// placement-check calls a running placement advisor the way a Go scheduler would: every
// PlacementAdvisor method with one good call and one error case each, the standard
// grpc.health.v1 health check, and server reflection (the served descriptor must match the
// one compiled into this program). It prints one JSON line per check and exits 1 when any
// check failed.
//
// Usage: placement-check -addr 127.0.0.1:50051 [-timeout 10s]
//
// The advisor must know at least one clique with two free, healthy nodes.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/types/descriptorpb"

	placementv1 "computedomains/integrations/placement-go/placementv1"
)

const serviceName = "computedomain.placement.v1.PlacementAdvisor"

type result struct {
	Check  string `json:"check"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail"`
}

type checker struct {
	failed bool
	out    *json.Encoder
}

func (c *checker) report(name string, err error, detail string) {
	r := result{Check: name, OK: err == nil, Detail: detail}
	if err != nil {
		c.failed = true
		r.Detail = err.Error()
	}
	_ = c.out.Encode(r)
}

// wantCode returns nil when err is a gRPC status with the given code.
func wantCode(err error, code codes.Code) error {
	if err == nil {
		return fmt.Errorf("call succeeded, want %s", code)
	}
	if got := status.Code(err); got != code {
		return fmt.Errorf("got %s (%v), want %s", got, err, code)
	}
	return nil
}

func main() {
	addr := flag.String("addr", "", "advisor gRPC address host:port")
	timeout := flag.Duration("timeout", 10*time.Second, "deadline of each call")
	flag.Parse()
	if *addr == "" {
		fmt.Fprintln(os.Stderr, "placement-check: -addr is required")
		os.Exit(2)
	}
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintf(os.Stderr, "placement-check: %v\n", err)
		os.Exit(2)
	}
	defer conn.Close()
	c := &checker{out: json.NewEncoder(os.Stdout)}
	ctx := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), *timeout)
	}
	checkHealth(c, conn, ctx)
	checkReflection(c, conn, ctx)
	checkPlacement(c, placementv1.NewPlacementAdvisorClient(conn), ctx)
	if c.failed {
		os.Exit(1)
	}
}

type ctxFunc func() (context.Context, context.CancelFunc)

func checkHealth(c *checker, conn *grpc.ClientConn, ctx ctxFunc) {
	health := healthpb.NewHealthClient(conn)
	for _, service := range []string{"", serviceName} {
		cx, cancel := ctx()
		resp, err := health.Check(cx, &healthpb.HealthCheckRequest{Service: service})
		cancel()
		if err == nil && resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			err = fmt.Errorf("status %s, want SERVING", resp.GetStatus())
		}
		c.report(fmt.Sprintf("health %q", service), err, "SERVING")
	}
	cx, cancel := ctx()
	_, err := health.Check(cx, &healthpb.HealthCheckRequest{Service: "no.such.Service"})
	cancel()
	c.report("health unknown service", wantCode(err, codes.NotFound), "NOT_FOUND")
}

func askReflection(conn *grpc.ClientConn, ctx ctxFunc, req *reflectionpb.ServerReflectionRequest) (*reflectionpb.ServerReflectionResponse, error) {
	cx, cancel := ctx()
	defer cancel()
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(cx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(req); err != nil {
		return nil, err
	}
	resp, err := stream.Recv()
	_ = stream.CloseSend()
	return resp, err
}

func checkReflection(c *checker, conn *grpc.ClientConn, ctx ctxFunc) {
	resp, err := askReflection(conn, ctx, &reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{ListServices: "*"},
	})
	var names []string
	if err == nil {
		for _, s := range resp.GetListServicesResponse().GetService() {
			names = append(names, s.GetName())
		}
		sort.Strings(names)
		want := []string{serviceName, "grpc.health.v1.Health"}
		for _, w := range want {
			if !contains(names, w) {
				err = fmt.Errorf("services %v lack %s", names, w)
			}
		}
	}
	c.report("reflection list", err, fmt.Sprint(names))

	resp, err = askReflection(conn, ctx, &reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: serviceName},
	})
	detail := ""
	if err == nil {
		err = sameService(resp.GetFileDescriptorResponse().GetFileDescriptorProto())
		detail = "served descriptor matches the compiled one"
	}
	c.report("reflection describe", err, detail)

	resp, err = askReflection(conn, ctx, &reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: "no.such.Symbol"},
	})
	if err == nil {
		if e := resp.GetErrorResponse(); e == nil || codes.Code(e.GetErrorCode()) != codes.NotFound {
			err = fmt.Errorf("got %v, want an error response NOT_FOUND", resp)
		}
	}
	c.report("reflection unknown symbol", err, "NOT_FOUND")
}

// sameService compares the served file's service and messages with the compiled-in file.
func sameService(files [][]byte) error {
	if len(files) == 0 {
		return errors.New("no file descriptor in the answer")
	}
	served := &descriptorpb.FileDescriptorProto{}
	if err := proto.Unmarshal(files[0], served); err != nil {
		return err
	}
	compiled := protodesc.ToFileDescriptorProto(placementv1.File_computedomain_placement_v1_placement_proto)
	compiled.Options = nil // go_package, given on the protoc command line, is ours alone
	served.Options = nil
	compiled.SourceCodeInfo = nil
	served.SourceCodeInfo = nil
	if !proto.Equal(served, compiled) {
		return fmt.Errorf("served %s differs from the compiled one", served.GetName())
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func checkPlacement(c *checker, client placementv1.PlacementAdvisorClient, ctx ctxFunc) {
	cx, cancel := ctx()
	capacity, err := client.GetCapacity(cx, &placementv1.GetCapacityRequest{})
	cancel()
	if err == nil && capacity.GetFreeNodes() < 2 {
		err = fmt.Errorf("free nodes %d, want >= 2", capacity.GetFreeNodes())
	}
	c.report("GetCapacity", err, fmt.Sprintf("%d free of %d", capacity.GetFreeNodes(), capacity.GetTotalNodes()))
	cx, cancel = ctx()
	_, err = client.GetCapacity(cx, &placementv1.GetCapacityRequest{NodeSelector: map[string]string{"colour": "blue"}})
	cancel()
	c.report("GetCapacity unknown selector key", wantCode(err, codes.InvalidArgument), "INVALID_ARGUMENT")

	// Watch first, so that the reservation below shows up as a new snapshot.
	wcx, wcancel := ctx()
	defer wcancel()
	watch, err := client.WatchCapacity(wcx, &placementv1.WatchCapacityRequest{MinIntervalMs: 10})
	var first *placementv1.Capacity
	if err == nil {
		first, err = watch.Recv()
	}
	c.report("WatchCapacity first snapshot", err, fmt.Sprintf("generation %d", first.GetGeneration()))

	req := &placementv1.PlaceRequest{NumNodes: 2, Mode: placementv1.PlacementMode_PLACEMENT_MODE_REQUIRE_SINGLE_CLIQUE, DryRun: true}
	cx, cancel = ctx()
	placed, err := client.Place(cx, req)
	cancel()
	if err == nil && (!placed.GetFeasible() || len(placed.GetPlacements()) != 1 || len(placed.GetPlacements()[0].GetNodeNames()) != 2) {
		err = fmt.Errorf("placement %v, want 2 nodes in one clique", placed)
	}
	c.report("Place", err, fmt.Sprint(placed.GetPlacements()))
	cx, cancel = ctx()
	_, err = client.Place(cx, &placementv1.PlaceRequest{NumNodes: 0})
	cancel()
	c.report("Place num_nodes=0", wantCode(err, codes.InvalidArgument), "INVALID_ARGUMENT")

	cx, cancel = ctx()
	explained, err := client.Explain(cx, &placementv1.ExplainRequest{Request: req, MaxAlternatives: 3})
	cancel()
	if err == nil && (len(explained.GetAlternatives()) == 0 || !explained.GetAlternatives()[0].GetChosen()) {
		err = fmt.Errorf("explanation %v, want the chosen alternative first", explained)
	}
	c.report("Explain", err, fmt.Sprintf("%d alternatives", len(explained.GetAlternatives())))
	cx, cancel = ctx()
	_, err = client.Explain(cx, &placementv1.ExplainRequest{Request: &placementv1.PlaceRequest{NumNodes: -1}})
	cancel()
	c.report("Explain num_nodes=-1", wantCode(err, codes.InvalidArgument), "INVALID_ARGUMENT")

	nodes := placed.GetPlacements()
	var names []string
	if len(nodes) > 0 {
		names = nodes[0].GetNodeNames()
	}
	cx, cancel = ctx()
	reserved, err := client.Reserve(cx, &placementv1.ReserveRequest{NodeNames: names, DomainUid: "go-client", TtlSeconds: 60, Holder: "placement-check"})
	cancel()
	c.report("Reserve", err, reserved.GetReservation().GetId())
	cx, cancel = ctx()
	_, err = client.Reserve(cx, &placementv1.ReserveRequest{NodeNames: names, DomainUid: "go-client-2", TtlSeconds: 60})
	cancel()
	c.report("Reserve taken nodes", wantCode(err, codes.Aborted), "ABORTED")

	if watch != nil && first != nil {
		var next *placementv1.Capacity
		var werr error
		for {
			next, werr = watch.Recv()
			if werr != nil || next.GetReservedNodes() >= first.GetReservedNodes()+2 {
				break
			}
		}
		if errors.Is(werr, io.EOF) {
			werr = errors.New("stream ended before the reservation showed")
		}
		c.report("WatchCapacity sees the reservation", werr, fmt.Sprintf("reserved %d -> %d", first.GetReservedNodes(), next.GetReservedNodes()))
	}
	wcancel()
	cx, cancel = ctx()
	badWatch, err := client.WatchCapacity(cx, &placementv1.WatchCapacityRequest{MinIntervalMs: -1})
	if err == nil {
		_, err = badWatch.Recv()
	}
	cancel()
	c.report("WatchCapacity min_interval_ms=-1", wantCode(err, codes.InvalidArgument), "INVALID_ARGUMENT")

	cx, cancel = ctx()
	_, err = client.Release(cx, &placementv1.ReleaseRequest{ReservationId: reserved.GetReservation().GetId(), Holder: "someone-else"})
	cancel()
	c.report("Release by another holder", wantCode(err, codes.PermissionDenied), "PERMISSION_DENIED")
	cx, cancel = ctx()
	released, err := client.Release(cx, &placementv1.ReleaseRequest{ReservationId: reserved.GetReservation().GetId(), Holder: "placement-check"})
	cancel()
	if err == nil && (!released.GetReleased() || len(released.GetNodeNames()) != 2) {
		err = fmt.Errorf("release %v, want both nodes released", released)
	}
	c.report("Release", err, fmt.Sprint(released.GetNodeNames()))
	cx, cancel = ctx()
	_, err = client.Release(cx, &placementv1.ReleaseRequest{ReservationId: ""})
	cancel()
	c.report("Release empty id", wantCode(err, codes.InvalidArgument), "INVALID_ARGUMENT")
}
