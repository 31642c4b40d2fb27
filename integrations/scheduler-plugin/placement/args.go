package placement

import (
	"fmt"
	"strings"
	"time"
)

// Args is the plugin's entry in the KubeSchedulerConfiguration's pluginConfig (JSON field names).
type Args struct {
	// AdvisorAddress is the placement advisor's gRPC endpoint, host:port (required).
	AdvisorAddress string `json:"advisorAddress"`
	// CallTimeout bounds every call to the advisor (Go duration; default 5s).
	CallTimeout string `json:"callTimeout,omitempty"`
	// ReservationTTLSeconds is how long the advisor holds a gang's nodes if the gang never
	// binds (default 120; the advisor caps it at its --max-reservation-ttl-s).
	ReservationTTLSeconds int32 `json:"reservationTTLSeconds,omitempty"`
	// GangWaitTimeout bounds how long a gang's scheduled pods wait at Permit for the rest of the
	// gang before the whole gang is rejected and its reservation released (Go duration; default
	// 60s; at most 15m, kube-scheduler's bound on a Permit wait).
	GangWaitTimeout string `json:"gangWaitTimeout,omitempty"`
	// Holder names this scheduler to the advisor: only the holder may release a reservation.
	Holder string `json:"holder,omitempty"`
	// TLS to the advisor (all empty = plaintext). CAFile alone verifies the server; with
	// CertFile and KeyFile the scheduler authenticates as the certificate's name (mutual TLS).
	CAFile     string `json:"caFile,omitempty"`
	CertFile   string `json:"certFile,omitempty"`
	KeyFile    string `json:"keyFile,omitempty"`
	ServerName string `json:"serverName,omitempty"`
}

const (
	defaultCallTimeout = 5 * time.Second
	defaultTTLSeconds  = 120
	defaultHolder      = "computedomain-scheduler"
	defaultGangWait    = 60 * time.Second
	maxGangWait        = 15 * time.Minute
)

// settings are the validated Args.
type settings struct {
	address     string
	callTimeout time.Duration
	gangWait    time.Duration
	ttlSeconds  int32
	holder      string
	tls         *tlsFiles
}

type tlsFiles struct {
	ca, cert, key, serverName string
}

func (a Args) settings() (settings, error) {
	s := settings{address: a.AdvisorAddress, callTimeout: defaultCallTimeout, gangWait: defaultGangWait, ttlSeconds: a.ReservationTTLSeconds, holder: a.Holder}
	if s.address == "" {
		return s, fmt.Errorf("%s args: advisorAddress is required (the placement advisor's gRPC host:port)", Name)
	}
	if a.CallTimeout != "" {
		d, err := time.ParseDuration(a.CallTimeout)
		if err != nil || d <= 0 {
			return s, fmt.Errorf("%s args: callTimeout %q is not a positive duration such as 5s", Name, a.CallTimeout)
		}
		s.callTimeout = d
	}
	if a.GangWaitTimeout != "" {
		d, err := time.ParseDuration(a.GangWaitTimeout)
		if err != nil || d <= 0 || d > maxGangWait {
			return s, fmt.Errorf("%s args: gangWaitTimeout %q is not a positive duration of at most %s, such as 60s", Name, a.GangWaitTimeout, maxGangWait)
		}
		s.gangWait = d
	}
	if s.ttlSeconds < 0 {
		return s, fmt.Errorf("%s args: reservationTTLSeconds must be >= 0, got %d", Name, s.ttlSeconds)
	}
	if s.ttlSeconds == 0 {
		s.ttlSeconds = defaultTTLSeconds
	}
	if s.holder == "" {
		s.holder = defaultHolder
	}
	if strings.Contains(s.holder, "/") {
		return s, fmt.Errorf("%s args: holder %q must not contain '/' (it is part of reservation ids)", Name, s.holder)
	}
	if (a.CertFile == "") != (a.KeyFile == "") {
		return s, fmt.Errorf("%s args: certFile and keyFile go together", Name)
	}
	if a.CAFile != "" || a.CertFile != "" {
		s.tls = &tlsFiles{ca: a.CAFile, cert: a.CertFile, key: a.KeyFile, serverName: a.ServerName}
	}
	return s, nil
}
