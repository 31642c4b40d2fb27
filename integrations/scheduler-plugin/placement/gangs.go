package placement

import (
	"fmt"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
)

// gang is what the plugin knows of one ComputeDomain's pods: the advisor's reservation and
// where the pods went. The first pod of a gang asks the advisor; the others use the answer.
type gang struct {
	domainUID string
	size      int32 // 0 = not known
	clique    string
	held      *reservation // nil once released (or never made)
	// Reservations made for this gang so far: the next one's id.
	sequence int
	// Pods assumed (Reserve) or bound (PostBind) -> node.
	pods     map[types.UID]string
	bound    sets.Set[types.UID]
	lastUsed time.Time
}

// gangs is the plugin's table of gangs, shared by the scheduling and binding goroutines.
type gangs struct {
	mu     sync.Mutex
	byUID  map[string]*gang
	holder string
	now    func() time.Time
	// A gang with no reservation and no activity for this long is forgotten.
	idle time.Duration
}

func newGangs(holder string, now func() time.Time) *gangs {
	return &gangs{byUID: map[string]*gang{}, holder: holder, now: now, idle: 30 * time.Minute}
}

// get returns the gang of a domain, made on first use.
func (g *gangs) get(domainUID string, size int32) *gang {
	found := g.byUID[domainUID]
	if found == nil {
		found = &gang{domainUID: domainUID, pods: map[types.UID]string{}, bound: sets.New[types.UID]()}
		g.byUID[domainUID] = found
	}
	if size > 0 {
		found.size = size
	}
	found.lastUsed = g.now()
	return found
}

// live drops a reservation the advisor has let expire (its TTL ran out before the gang bound).
func (x *gang) live(now time.Time) *reservation {
	if x.held != nil && !now.Before(x.held.expires) {
		x.held = nil
	}
	return x.held
}

// nodesInUse are the nodes the gang's pods are assumed on or bound to.
func (x *gang) nodesInUse() sets.Set[string] {
	used := sets.New[string]()
	for _, node := range x.pods {
		used.Insert(node)
	}
	return used
}

// free are the reserved nodes no pod of the gang has taken yet.
func (x *gang) free(now time.Time) sets.Set[string] {
	held := x.live(now)
	if held == nil {
		return sets.New[string]()
	}
	return sets.New(held.nodes...).Difference(x.nodesInUse())
}

// wanted is how many nodes to ask for: the rest of the gang, or one more node.
func (x *gang) wanted() int32 {
	rest := x.size - int32(len(x.nodesInUse()))
	if rest < 1 {
		return 1
	}
	return rest
}

// nextID is the id of the gang's next reservation: fixed per holder, domain and sequence, so a
// restarted scheduler finds (and releases) what it held before.
func (x *gang) nextID(holder string) string {
	x.sequence++
	return fmt.Sprintf("%s.%s.%d", holder, x.domainUID, x.sequence)
}

// served says whether every reserved node has a bound pod of the gang: the reservation has done
// its job, and the bound pods' claims hold the nodes from now on.
func (x *gang) served() bool {
	if x.held == nil {
		return false
	}
	boundNodes := sets.New[string]()
	for uid := range x.bound {
		boundNodes.Insert(x.pods[uid])
	}
	return boundNodes.HasAll(x.held.nodes...)
}

// busyElsewhere are nodes that pods of other gangs are assumed on or bound to: the advisor only
// learns of them when their claims are prepared, so they are excluded from this gang's request.
func (g *gangs) busyElsewhere(domainUID string) []string {
	busy := sets.New[string]()
	for uid, other := range g.byUID {
		if uid != domainUID {
			busy = busy.Union(other.nodesInUse())
		}
	}
	return sets.List(busy)
}

// forgetPod drops a deleted pod: its node is no longer the gang's.
func (g *gangs) forgetPod(uid types.UID) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, x := range g.byUID {
		delete(x.pods, uid)
		x.bound.Delete(uid)
	}
}

// forgetIdle drops gangs that hold nothing and saw no pod for a while.
func (g *gangs) forgetIdle() {
	now := g.now()
	for uid, x := range g.byUID {
		if x.live(now) == nil && now.Sub(x.lastUsed) > g.idle {
			delete(g.byUID, uid)
		}
	}
}
