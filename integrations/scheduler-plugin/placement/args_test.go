package placement

import (
	"strings"
	"testing"
	"time"
)

func TestGangWaitTimeoutDefaultsToAMinuteAndMustBeAPermitBound(t *testing.T) {
	s, err := Args{AdvisorAddress: "advisor:50051"}.settings()
	if err != nil || s.gangWait != time.Minute {
		t.Fatalf("default gang wait = %v (%v), want 1m", s.gangWait, err)
	}
	s, err = Args{AdvisorAddress: "advisor:50051", GangWaitTimeout: "90s"}.settings()
	if err != nil || s.gangWait != 90*time.Second {
		t.Fatalf("gang wait = %v (%v), want 90s", s.gangWait, err)
	}
	for _, bad := range []string{"soon", "0s", "-5s", "16m"} {
		_, err := Args{AdvisorAddress: "advisor:50051", GangWaitTimeout: bad}.settings()
		if err == nil || !strings.Contains(err.Error(), "gangWaitTimeout") {
			t.Fatalf("gangWaitTimeout %q: err %v, want one naming gangWaitTimeout", bad, err)
		}
	}
}
