// Package gang is what cd-scheduler's plugin knows of each ComputeDomain's pods (a gang): the
// advisor's reservation for it and where its pods went. No Kubernetes client and no network: the
// plugin (package placement) drives it.
package gang

import (
	"fmt"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
)

// Reservation is the advisor's hold on a gang's nodes.
type Reservation struct {
	ID      string
	Nodes   []string
	Clique  string
	Expires time.Time
}

// Gang is one ComputeDomain's pods. The first pod of a gang asks the advisor; the others use the
// answer.
type Gang struct {
	DomainUID string
	Size      int32 // 0 = not known
	Clique    string
	Held      *Reservation // nil once released (or never made)
	// Reservations made for this gang so far: the next one's id.
	sequence int
	// Pods assumed (Reserve) or bound (PostBind) -> node.
	pods  map[types.UID]string
	bound sets.Set[types.UID]
	// Assumed pods held at Permit until the gang is whole (so no part of a gang binds alone).
	waiting sets.Set[types.UID]
	// The advisor's last answer that the gang does not fit, and when it came: the gang's other
	// pods, each retried on every cluster event, take it rather than ask again for a while.
	noRoom   string
	noRoomAt time.Time
	lastUsed time.Time
}

// Table is the plugin's table of gangs, shared by the scheduling and binding goroutines: hold its
// lock around every use but ForgetPod.
type Table struct {
	sync.Mutex
	byUID  map[string]*Gang
	Holder string
	Now    func() time.Time
	// A gang with no reservation and no activity for this long is forgotten.
	idle time.Duration
}

// NewTable makes the table of a holder (the scheduler's name to the advisor).
func NewTable(holder string, now func() time.Time) *Table {
	return &Table{byUID: map[string]*Gang{}, Holder: holder, Now: now, idle: 30 * time.Minute}
}

// Has says whether the table knows the domain's gang (a restarted scheduler knows none).
func (t *Table) Has(domainUID string) bool {
	_, found := t.byUID[domainUID]
	return found
}

// Get returns the gang of a domain, made on first use; size > 0 sets its size.
func (t *Table) Get(domainUID string, size int32) *Gang {
	found := t.byUID[domainUID]
	if found == nil {
		found = &Gang{
			DomainUID: domainUID, pods: map[types.UID]string{}, bound: sets.New[types.UID](), waiting: sets.New[types.UID](),
		}
		t.byUID[domainUID] = found
	}
	if size > 0 {
		found.Size = size
	}
	found.lastUsed = t.Now()
	return found
}

// Live drops a reservation the advisor has let expire (its TTL ran out before the gang bound).
func (x *Gang) Live(now time.Time) *Reservation {
	if x.Held != nil && !now.Before(x.Held.Expires) {
		x.Held = nil
	}
	return x.Held
}

// NodesInUse are the nodes the gang's pods are assumed on or bound to.
func (x *Gang) NodesInUse() sets.Set[string] {
	used := sets.New[string]()
	for _, node := range x.pods {
		used.Insert(node)
	}
	return used
}

// Free are the reserved nodes no pod of the gang has taken yet.
func (x *Gang) Free(now time.Time) sets.Set[string] {
	held := x.Live(now)
	if held == nil {
		return sets.New[string]()
	}
	return sets.New(held.Nodes...).Difference(x.NodesInUse())
}

// Wanted is how many nodes to ask for: the rest of the gang, or one more node.
func (x *Gang) Wanted() int32 {
	rest := x.Size - int32(len(x.NodesInUse()))
	if rest < 1 {
		return 1
	}
	return rest
}

// FirstID is the id of the gang's first reservation (NextID's first answer): what an earlier
// run of this holder reserved for the gang.
func (x *Gang) FirstID(holder string) string {
	return fmt.Sprintf("%s.%s.%d", holder, x.DomainUID, 1)
}

// NextID is the id of the gang's next reservation: fixed per holder, domain and sequence, so a
// restarted scheduler finds (and releases) what it held before.
func (x *Gang) NextID(holder string) string {
	x.sequence++
	return fmt.Sprintf("%s.%s.%d", holder, x.DomainUID, x.sequence)
}

// Assume records the node a pod of the gang is assumed on (the scheduler's Reserve).
func (x *Gang) Assume(pod types.UID, node string) {
	x.pods[pod] = node
}

// Unassume forgets the node of a pod that did not bind (Unreserve); a bound pod keeps it.
func (x *Gang) Unassume(pod types.UID) {
	if !x.bound.Has(pod) {
		delete(x.pods, pod)
	}
}

// Bind records a pod of the gang bound to its node (PostBind).
func (x *Gang) Bind(pod types.UID, node string) {
	x.pods[pod] = node
	x.bound.Insert(pod)
}

// Served says whether every reserved node has a bound pod of the gang: the reservation has done
// its job, and the bound pods' claims hold the nodes from now on.
func (x *Gang) Served() bool {
	if x.Held == nil {
		return false
	}
	boundNodes := sets.New[string]()
	for uid := range x.bound {
		boundNodes.Insert(x.pods[uid])
	}
	return boundNodes.HasAll(x.Held.Nodes...)
}

// RecordNoRoom keeps the advisor's answer that the gang does not fit ("" forgets it).
func (x *Gang) RecordNoRoom(now time.Time, message string) {
	x.noRoom, x.noRoomAt = message, now
}

// RecentNoRoom is the advisor's answer that the gang does not fit if it came less than `within`
// before now, else "".
func (x *Gang) RecentNoRoom(now time.Time, within time.Duration) string {
	if x.noRoom == "" || !now.Before(x.noRoomAt.Add(within)) {
		return ""
	}
	return x.noRoom
}

// Whole says whether a gang of known size has all its pods assumed or bound.
func (x *Gang) Whole() bool {
	return x.Size > 0 && int32(len(x.pods)) >= x.Size
}

// Has says whether the pod is assumed or bound as one of the gang's.
func (x *Gang) Has(pod types.UID) bool {
	_, found := x.pods[pod]
	return found
}

// Hold records an assumed pod waiting at Permit for the rest of its gang.
func (x *Gang) Hold(pod types.UID) {
	x.waiting.Insert(pod)
}

// Waiting are the pods held at Permit.
func (x *Gang) Waiting() []types.UID {
	return sets.List(x.waiting)
}

// Let ends a held pod's wait (it was allowed to bind).
func (x *Gang) Let(pod types.UID) {
	x.waiting.Delete(pod)
}

// GiveUp ends the gang's wait when a held pod is rejected (the wait timed out, or a sibling
// failed): the other held pods are to be rejected too, and, when no pod of the gang is bound,
// its reservation is returned to be released, so that no part of the gang holds nodes. ok is
// false when the pod was not held (nothing to give up: e.g. it failed after it was allowed).
func (x *Gang) GiveUp(pod types.UID) (others []types.UID, drop *Reservation, ok bool) {
	if !x.waiting.Has(pod) {
		return nil, nil, false
	}
	others = sets.List(x.waiting.Delete(pod))
	x.waiting = sets.New[types.UID]()
	if x.bound.Len() == 0 {
		drop, x.Held = x.Held, nil
	}
	return others, drop, true
}

// BusyElsewhere are nodes that pods of other gangs are assumed on or bound to: the advisor only
// learns of them when their claims are prepared, so they are excluded from this gang's request.
func (t *Table) BusyElsewhere(domainUID string) []string {
	busy := sets.New[string]()
	for uid, other := range t.byUID {
		if uid != domainUID {
			busy = busy.Union(other.NodesInUse())
		}
	}
	return sets.List(busy)
}

// ForgetPod drops a deleted pod: its node is no longer its gang's. It takes the lock itself.
func (t *Table) ForgetPod(uid types.UID) {
	t.Lock()
	defer t.Unlock()
	for _, x := range t.byUID {
		delete(x.pods, uid)
		x.bound.Delete(uid)
		x.waiting.Delete(uid)
	}
}

// ForgetIdle drops gangs that hold nothing and saw no pod for a while.
func (t *Table) ForgetIdle() {
	now := t.Now()
	for uid, x := range t.byUID {
		if x.Live(now) == nil && now.Sub(x.lastUsed) > t.idle {
			delete(t.byUID, uid)
		}
	}
}
