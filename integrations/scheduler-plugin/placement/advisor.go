package placement

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	placementv1 "computedomains/integrations/placement-go/placementv1"

	"computedomains/integrations/scheduler-plugin/gang"
)

// advisorClient asks the placement advisor for a gang's nodes and holds them (Place, then
// Reserve), and releases them once the gang is bound. Every call is bounded by callTimeout.
type advisorClient struct {
	address     string
	callTimeout time.Duration
	ttlSeconds  int32
	holder      string
	api         placementv1.PlacementAdvisorClient
	conn        *grpc.ClientConn
}

// errUnavailable marks a failure to reach the advisor (down, hung, not synced yet): the pod
// waits and is retried, nothing is reserved.
var errUnavailable = errors.New("placement advisor unavailable")

// refused is the advisor's answer that the request itself is wrong (INVALID_ARGUMENT: e.g. a
// gang larger than the cluster): asking again changes nothing.
type refused struct {
	message string
}

func (e *refused) Error() string {
	return e.message
}

// infeasible is the advisor's answer that the gang does not fit now (a valid request).
type infeasible struct {
	reason, message string
}

func (e *infeasible) Error() string {
	return fmt.Sprintf("%s: %s", e.reason, e.message)
}

func newAdvisorClient(s settings) (*advisorClient, error) {
	creds := insecure.NewCredentials()
	if s.tls != nil {
		config, err := tlsConfig(s.tls)
		if err != nil {
			return nil, err
		}
		creds = credentials.NewTLS(config)
	}
	conn, err := grpc.NewClient(s.address,
		grpc.WithTransportCredentials(creds),
		// A restarted advisor is found again within seconds (gRPC's default backoff reaches 120 s).
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 500 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 5 * time.Second},
			MinConnectTimeout: s.callTimeout,
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("placement advisor address %q: %w", s.address, err)
	}
	return &advisorClient{
		address: s.address, callTimeout: s.callTimeout, ttlSeconds: s.ttlSeconds, holder: s.holder,
		api: placementv1.NewPlacementAdvisorClient(conn), conn: conn,
	}, nil
}

func tlsConfig(files *tlsFiles) (*tls.Config, error) {
	config := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: files.serverName}
	if files.ca != "" {
		pem, err := os.ReadFile(files.ca)
		if err != nil {
			return nil, fmt.Errorf("%s args: caFile: %w", Name, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s args: caFile %s holds no PEM certificate", Name, files.ca)
		}
		config.RootCAs = pool
	}
	if files.cert != "" {
		pair, err := tls.LoadX509KeyPair(files.cert, files.key)
		if err != nil {
			return nil, fmt.Errorf("%s args: certFile/keyFile: %w", Name, err)
		}
		config.Certificates = []tls.Certificate{pair}
	}
	return config, nil
}

// gangRequest is what the plugin asks for one gang (or one more node of it).
type gangRequest struct {
	domainUID     string
	numNodes      int32
	clique        string // "" = any clique
	candidates    []string
	excluded      []string
	sizeKnown     bool
	reservationID string
}

// placeAndReserve asks where the gang goes (Place, no write), then holds exactly those nodes
// (Reserve). A node taken between the two (ABORTED) starts over, at most three times. An id
// left by an earlier run of this scheduler (ALREADY_EXISTS) is released first: this holder made it.
func (c *advisorClient) placeAndReserve(ctx context.Context, req gangRequest) (*gang.Reservation, error) {
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		placed, err := c.place(ctx, req)
		if err != nil {
			return nil, err
		}
		held, err := c.reserve(ctx, req, placed)
		if err == nil {
			return held, nil
		}
		switch status.Code(err) {
		case codes.Aborted, codes.FailedPrecondition:
			// A node was taken, or turned unhealthy, since Place: ask again.
			lastErr = err
			continue
		case codes.AlreadyExists:
			if _, relErr := c.release(ctx, req.reservationID); relErr != nil {
				return nil, relErr
			}
			lastErr = err
			continue
		}
		return nil, c.wrap("Reserve", err)
	}
	return nil, fmt.Errorf("placement advisor at %s: Reserve kept conflicting with other schedulers: %w", c.address, lastErr)
}

func (c *advisorClient) place(ctx context.Context, req gangRequest) (*placementv1.PlaceResponse, error) {
	policy := placementv1.Policy_POLICY_BEST_FIT
	if !req.sizeKnown {
		// One node at a time: start where the domain has the most room to grow.
		policy = placementv1.Policy_POLICY_SPREAD
	}
	msg := &placementv1.PlaceRequest{
		NumNodes:       req.numNodes,
		Mode:           placementv1.PlacementMode_PLACEMENT_MODE_REQUIRE_SINGLE_CLIQUE,
		Policy:         policy,
		DomainUid:      req.domainUID,
		CandidateNodes: req.candidates,
		ExcludedNodes:  req.excluded,
		Holder:         c.holder,
	}
	if req.clique != "" {
		msg.NodeSelector = map[string]string{"clique": req.clique}
	}
	callCtx, cancel := context.WithTimeout(ctx, c.callTimeout)
	defer cancel()
	resp, err := c.api.Place(callCtx, msg)
	if err != nil {
		return nil, c.wrap("Place", err)
	}
	if !resp.GetFeasible() {
		return nil, &infeasible{reason: strings.TrimPrefix(resp.GetReason().String(), "REASON_"), message: resp.GetMessage()}
	}
	return resp, nil
}

func (c *advisorClient) reserve(ctx context.Context, req gangRequest, placed *placementv1.PlaceResponse) (*gang.Reservation, error) {
	var nodes []string
	clique := ""
	for _, segment := range placed.GetPlacements() {
		nodes = append(nodes, segment.GetNodeNames()...)
		clique = segment.GetCliqueId()
	}
	callCtx, cancel := context.WithTimeout(ctx, c.callTimeout)
	defer cancel()
	resp, err := c.api.Reserve(callCtx, &placementv1.ReserveRequest{
		NodeNames:     nodes,
		DomainUid:     req.domainUID,
		TtlSeconds:    c.ttlSeconds,
		Holder:        c.holder,
		ReservationId: req.reservationID,
	})
	if err != nil {
		return nil, err
	}
	info := resp.GetReservation()
	return &gang.Reservation{
		ID:      info.GetId(),
		Nodes:   info.GetNodeNames(),
		Clique:  clique,
		Expires: time.UnixMilli(info.GetExpiresUnixMs()),
	}, nil
}

// release gives the reservation back; false when the advisor no longer had it (expired).
func (c *advisorClient) release(ctx context.Context, id string) (bool, error) {
	callCtx, cancel := context.WithTimeout(ctx, c.callTimeout)
	defer cancel()
	resp, err := c.api.Release(callCtx, &placementv1.ReleaseRequest{ReservationId: id, Holder: c.holder})
	if err != nil {
		return false, c.wrap("Release", err)
	}
	return resp.GetReleased(), nil
}

// wrap names the advisor and the call; unreachable, timed out or not ready is errUnavailable.
func (c *advisorClient) wrap(call string, err error) error {
	code := status.Code(err)
	if code == codes.InvalidArgument {
		return &refused{message: fmt.Sprintf("placement advisor at %s: %s refused: %s", c.address, call, status.Convert(err).Message())}
	}
	if code == codes.Unavailable || code == codes.DeadlineExceeded || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: %s at %s: %s", errUnavailable, call, c.address, status.Convert(err).Message())
	}
	return fmt.Errorf("placement advisor at %s: %s: %s: %s", c.address, call, code, status.Convert(err).Message())
}

func (c *advisorClient) close() {
	_ = c.conn.Close()
}
