package gang

import (
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
)

var t0 = time.Unix(1_800_000_000, 0)

func gangWith(size int32, reserved []string, expires time.Time) *Gang {
	g := NewTable("sched", func() time.Time { return t0 }).Get("uid-1", size)
	g.Held = &Reservation{ID: "sched.uid-1.1", Nodes: reserved, Clique: "c1", Expires: expires}
	return g
}

func TestFreeIsTheReservedNodesNoPodTook(t *testing.T) {
	g := gangWith(3, []string{"a", "b", "c"}, t0.Add(time.Minute))
	g.Assume(types.UID("p1"), "b")
	if got := sets.List(g.Free(t0)); strings.Join(got, ",") != "a,c" {
		t.Fatalf("free = %v, want [a c]", got)
	}
	if got := g.Wanted(); got != 2 {
		t.Fatalf("wanted = %d, want the rest of the gang, 2", got)
	}
}

func TestAnExpiredReservationHoldsNothing(t *testing.T) {
	g := gangWith(3, []string{"a", "b", "c"}, t0.Add(time.Minute))
	if g.Free(t0.Add(time.Minute)).Len() != 0 || g.Held != nil {
		t.Fatalf("an expired reservation still offers nodes: %v", g.Held)
	}
}

func TestWantedIsOneMoreNodeBeyondTheGangOrWhenTheSizeIsUnknown(t *testing.T) {
	g := gangWith(2, []string{"a", "b"}, t0.Add(time.Minute))
	g.Assume("p1", "a")
	g.Assume("p2", "b")
	if got := g.Wanted(); got != 1 {
		t.Fatalf("wanted = %d for a third pod of a gang of 2, want 1", got)
	}
	if got := gangWith(0, nil, t0).Wanted(); got != 1 {
		t.Fatalf("wanted = %d with no size, want 1", got)
	}
}

func TestServedOnlyOnceEveryReservedNodeHasABoundPod(t *testing.T) {
	g := gangWith(2, []string{"a", "b"}, t0.Add(time.Minute))
	g.Assume("p1", "a")
	g.Assume("p2", "b")
	g.Bind("p1", "a")
	if g.Served() {
		t.Fatal("served with one of two pods bound (the other only assumed)")
	}
	g.Bind("p2", "b")
	if !g.Served() {
		t.Fatal("not served with both pods bound")
	}
}

func TestOtherGangsNodesAreExcludedAndADeletedPodFreesItsNode(t *testing.T) {
	table := NewTable("sched", func() time.Time { return t0 })
	mine, other := table.Get("uid-1", 2), table.Get("uid-2", 2)
	mine.Assume("p1", "a")
	other.Bind("p2", "b")
	other.Assume("p3", "c")
	if got := strings.Join(table.BusyElsewhere("uid-1"), ","); got != "b,c" {
		t.Fatalf("busyElsewhere = %s, want b,c", got)
	}
	table.ForgetPod("p2")
	if got := strings.Join(table.BusyElsewhere("uid-1"), ","); got != "c" {
		t.Fatalf("busyElsewhere after p2 went = %s, want c", got)
	}
}

func TestReservationIDsAreFixedPerHolderDomainAndSequence(t *testing.T) {
	g := NewTable("sched", func() time.Time { return t0 }).Get("uid-1", 2)
	if a, b := g.NextID("sched"), g.NextID("sched"); a != "sched.uid-1.1" || b != "sched.uid-1.2" {
		t.Fatalf("ids %s, %s", a, b)
	}
}

func TestIdleGangsAreForgottenHoldingOnesKept(t *testing.T) {
	now := t0
	table := NewTable("sched", func() time.Time { return now })
	table.Get("idle", 2)
	holding := table.Get("holding", 2)
	holding.Held = &Reservation{ID: "x", Nodes: []string{"a"}, Expires: t0.Add(2 * time.Hour)}
	now = t0.Add(time.Hour)
	table.ForgetIdle()
	if _, ok := table.byUID["idle"]; ok {
		t.Fatal("an idle gang holding nothing was kept")
	}
	if _, ok := table.byUID["holding"]; !ok {
		t.Fatal("a gang holding a live reservation was forgotten")
	}
}

func TestAPodThatDidNotBindGivesItsNodeBackABoundOneKeepsIt(t *testing.T) {
	g := gangWith(2, []string{"a", "b"}, t0.Add(time.Minute))
	g.Assume("p1", "a")
	g.Bind("p2", "b")
	g.Unassume("p1")
	g.Unassume("p2")
	if got := strings.Join(sets.List(g.Free(t0)), ","); got != "a" {
		t.Fatalf("free = %s, want a", got)
	}
}

func TestARestartedTableKnowsNoGangAndNamesTheEarlierRunsFirstReservation(t *testing.T) {
	table := NewTable("sched", func() time.Time { return t0 })
	if table.Has("uid-1") {
		t.Fatal("a new table knows a gang")
	}
	g := table.Get("uid-1", 3)
	if !table.Has("uid-1") {
		t.Fatal("the table forgot the gang it made")
	}
	if first, next := g.FirstID("sched"), g.NextID("sched"); first != next {
		t.Fatalf("FirstID %q is not NextID's first answer %q", first, next)
	}
}
