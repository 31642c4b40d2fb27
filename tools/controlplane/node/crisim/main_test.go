package main

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"
)

func TestExitRule(t *testing.T) {
	cases := []struct {
		argv  []string
		after time.Duration
		code  int32
		ok    bool
	}{
		{[]string{"sleep", "3"}, 3 * time.Second, 0, true},
		{[]string{"/bin/sleep", "0.5"}, 500 * time.Millisecond, 0, true},
		{[]string{"sh", "-c", "sleep 2; exit 7"}, 2 * time.Second, 7, true},
		{[]string{"/bin/bash", "-c", " sleep 1 ;exit 0 "}, time.Second, 0, true},
		{[]string{"sleep", "infinity"}, 0, 0, false},
		{[]string{"sleep", "99999999999999"}, 0, 0, false},
		{[]string{"sh", "-c", "sleep 2; exit 256"}, 0, 0, false},
		{[]string{"sh", "-c", "sleep 2; exit 1; echo"}, 0, 0, false},
		{[]string{"sh", "-c", "sleep 2"}, 0, 0, false},
		{[]string{"python", "-c", "sleep 2; exit 1"}, 0, 0, false},
		{[]string{"bash", "-c", "ls; sleep infinity"}, 0, 0, false},
		{nil, 0, 0, false},
	}
	for _, c := range cases {
		after, code, ok := exitRule(c.argv)
		if after != c.after || code != c.code || ok != c.ok {
			t.Errorf("exitRule(%q) = %v, %d, %v; want %v, %d, %v", c.argv, after, code, ok, c.after, c.code, c.ok)
		}
	}
}

func TestUnresolvableCDIDevices(t *testing.T) {
	dir := t.TempDir()
	spec := `{"cdiVersion":"0.5.0","kind":"k8s.compute-domain.nvidia.com/claim","devices":[{"name":"u1-channel-0","containerEdits":{}}]}`
	if err := os.WriteFile(filepath.Join(dir, "k8s.compute-domain.nvidia.com-claim_u1.json"), []byte(spec), 0o644); err != nil {
		t.Fatal(err)
	}
	missing, err := unresolvableCDIDevices(dir, []string{
		"k8s.compute-domain.nvidia.com/claim=u1-channel-0",
		"k8s.compute-domain.nvidia.com/claim=u2-channel-0",
		"nvidia.com/gpu=0",
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"k8s.compute-domain.nvidia.com/claim=u2-channel-0", "nvidia.com/gpu=0"}
	if !reflect.DeepEqual(missing, want) {
		t.Errorf("missing = %q; want %q", missing, want)
	}
	if err := os.WriteFile(filepath.Join(dir, "broken.json"), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := unresolvableCDIDevices(dir, []string{"k8s.compute-domain.nvidia.com/claim=u1-channel-0"}); err == nil {
		t.Error("a spec that does not parse was not reported")
	}
}
