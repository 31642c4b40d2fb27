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

func TestWholeOnceEveryPodOfTheGangIsAssumedOrBound(t *testing.T) {
	g := gangWith(3, []string{"a", "b", "c"}, t0.Add(time.Minute))
	g.Bind("p1", "a")
	g.Assume("p2", "b")
	if g.Whole() {
		t.Fatal("whole with two of three pods")
	}
	g.Assume("p3", "c")
	if !g.Whole() {
		t.Fatal("not whole with one pod bound and two assumed of three")
	}
	if gangWith(0, nil, t0).Whole() {
		t.Fatal("a gang of unknown size is never whole")
	}
}

func TestGivingUpRejectsTheOtherHeldPodsAndDropsAnUnusedReservation(t *testing.T) {
	g := gangWith(3, []string{"a", "b", "c"}, t0.Add(time.Minute))
	held := g.Held
	g.Assume("p1", "a")
	g.Hold("p1")
	g.Assume("p2", "b")
	g.Hold("p2")
	g.Unassume("p1") // its wait timed out
	others, drop, ok := g.GiveUp("p1")
	if !ok || len(others) != 1 || others[0] != "p2" {
		t.Fatalf("give up = %v, %v: want the other held pod p2", others, ok)
	}
	if drop != held || g.Held != nil {
		t.Fatalf("the reservation of a gang with no bound pod is to be released: drop %v, held %v", drop, g.Held)
	}
	if len(g.Waiting()) != 0 {
		t.Fatalf("still held: %v", g.Waiting())
	}
	// p2's own Unreserve, after its rejection, gives up nothing more.
	g.Unassume("p2")
	if _, _, ok := g.GiveUp("p2"); ok {
		t.Fatal("a pod no longer held gave the gang up again")
	}
}

func TestGivingUpKeepsTheReservationOfAGangWithBoundPods(t *testing.T) {
	g := gangWith(3, []string{"a", "b", "c"}, t0.Add(time.Minute))
	g.Bind("p0", "a") // bound before (an adopted gang)
	g.Assume("p1", "b")
	g.Hold("p1")
	g.Unassume("p1")
	if _, drop, ok := g.GiveUp("p1"); !ok || drop != nil || g.Held == nil {
		t.Fatalf("a gang with a bound pod dropped its reservation: drop %v ok %v", drop, ok)
	}
}

func TestAPodAllowedToBindIsNoLongerHeld(t *testing.T) {
	g := gangWith(2, []string{"a", "b"}, t0.Add(time.Minute))
	g.Assume("p1", "a")
	g.Hold("p1")
	g.Let("p1")
	if _, _, ok := g.GiveUp("p1"); ok {
		t.Fatal("a pod let through gave its gang up when it failed later")
	}
}

func TestAForgottenPodIsNoLongerHeld(t *testing.T) {
	table := NewTable("sched", func() time.Time { return t0 })
	g := table.Get("uid-1", 2)
	g.Assume("p1", "a")
	g.Hold("p1")
	table.ForgetPod("p1")
	if len(g.Waiting()) != 0 || g.Has("p1") {
		t.Fatalf("a deleted pod is still held: %v", g.Waiting())
	}
}

func TestANoRoomAnswerServesTheGangsOtherPodsForAWhile(t *testing.T) {
	g := gangWith(3, nil, t0)
	if got := g.RecentNoRoom(t0, time.Second); got != "" {
		t.Fatalf("an answer before any was asked: %q", got)
	}
	g.RecordNoRoom(t0, "no room for 3")
	if got := g.RecentNoRoom(t0.Add(999*time.Millisecond), time.Second); got != "no room for 3" {
		t.Fatalf("within the second: %q, want the answer", got)
	}
	if got := g.RecentNoRoom(t0.Add(time.Second), time.Second); got != "" {
		t.Fatalf("a second later: %q, want none (ask the advisor again)", got)
	}
	g.RecordNoRoom(t0, "")
	if got := g.RecentNoRoom(t0, time.Second); got != "" {
		t.Fatalf("a forgotten answer still served: %q", got)
	}
}
