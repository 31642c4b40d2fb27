// Package placement is a kube-scheduler framework plugin that places each ComputeDomain's pods
// (a gang) through the placement advisor: the first pod of a gang asks the advisor where the
// whole gang goes (Place, then Reserve); that pod and the gang's later ones may only use the
// reserved nodes (PreFilter narrows the nodes, Filter refuses others, Score ranks reserved ones
// first); each pod waits at Permit until the whole gang is scheduled, and the gang's pending pods
// are moved to the active queue once one of them is assumed (gangwait.go); once every reserved
// node has a bound pod of the gang, the reservation is released (PostBind). With the advisor
// unreachable the gang's pods wait, retried with backoff, and
// nothing is reserved or bound.
package placement

import (
	"context"
	"errors"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	corelisters "k8s.io/client-go/listers/core/v1"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	frameworkruntime "k8s.io/kubernetes/pkg/scheduler/framework/runtime"

	"computedomains/integrations/scheduler-plugin/gang"
)

// Name is the plugin's name in a KubeSchedulerConfiguration profile.
const Name = "ComputeDomainPlacement"

const stateKey fwk.StateKey = Name + "/gang"

// The Node label the node agent keeps at its node's NVLink clique (the advisor's clique id).
const cliqueLabel = "nvidia.com/gpu.clique"

// Plugin is the framework plugin.
type Plugin struct {
	advisor   *advisorClient
	templates resourcelisters.ResourceClaimTemplateLister
	pods      corelisters.PodLister
	domains   cache.Indexer // ComputeDomains by uid (for spec.numNodes); nil without a kubeconfig
	gangs     *gang.Table
	handle    fwk.Handle
	gangWait  time.Duration // the longest a gang's pods wait at Permit for the rest of it
	// Gangs whose held pods a settle check is due for, and gangs one of whose pods is to be
	// tried again once their "no room" answer is stale (under the table's lock).
	settling sets.Set[string]
	probing  sets.Set[string]
	logger   klog.Logger
}

var (
	_ fwk.PreFilterPlugin = &Plugin{}
	_ fwk.FilterPlugin    = &Plugin{}
	_ fwk.PreScorePlugin  = &Plugin{}
	_ fwk.ScorePlugin     = &Plugin{}
	_ fwk.ReservePlugin   = &Plugin{}
	_ fwk.PermitPlugin    = &Plugin{}
	_ fwk.PostBindPlugin  = &Plugin{}
)

// cycleState is what PreFilter decided for the pod in this scheduling cycle.
type cycleState struct {
	domainUID     string
	reservationID string
	allowed       sets.Set[string]
}

func (s *cycleState) Clone() fwk.StateData { return s }

// New builds the plugin from its args (pluginConfig) and the framework handle.
func New(ctx context.Context, obj runtime.Object, handle fwk.Handle) (fwk.Plugin, error) {
	var args Args
	if err := frameworkruntime.DecodeInto(obj, &args); err != nil {
		return nil, fmt.Errorf("%s args: %w", Name, err)
	}
	s, err := args.settings()
	if err != nil {
		return nil, err
	}
	client, err := newAdvisorClient(s)
	if err != nil {
		return nil, err
	}
	p := &Plugin{
		advisor:   client,
		templates: handle.SharedInformerFactory().Resource().V1().ResourceClaimTemplates().Lister(),
		pods:      handle.SharedInformerFactory().Core().V1().Pods().Lister(),
		gangs:     gang.NewTable(s.holder, time.Now),
		handle:    handle,
		gangWait:  s.gangWait,
		settling:  sets.New[string](),
		probing:   sets.New[string](),
		logger:    klog.FromContext(ctx),
	}
	_, _ = handle.SharedInformerFactory().Core().V1().Pods().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		DeleteFunc: func(obj interface{}) {
			if tombstone, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tombstone.Obj
			}
			if pod, ok := obj.(*v1.Pod); ok {
				p.gangs.ForgetPod(pod.UID)
			}
		},
	})
	if config := handle.KubeConfig(); config != nil {
		dyn, err := dynamic.NewForConfig(config)
		if err != nil {
			return nil, fmt.Errorf("%s: dynamic client: %w", Name, err)
		}
		factory := dynamicinformer.NewDynamicSharedInformerFactory(dyn, 0)
		informer := factory.ForResource(computeDomains).Informer()
		if err := informer.AddIndexers(cache.Indexers{uidIndex: byUID}); err != nil {
			return nil, err
		}
		p.domains = informer.GetIndexer()
		factory.Start(ctx.Done())
	}
	go func() {
		<-ctx.Done()
		client.close()
	}()
	klog.FromContext(ctx).Info("ComputeDomain placement plugin ready", "advisor", s.address, "holder", s.holder, "callTimeout", s.callTimeout, "gangWaitTimeout", s.gangWait)
	return p, nil
}

// Name implements fwk.Plugin.
func (p *Plugin) Name() string { return Name }

// PreFilter finds the pod's gang and the nodes reserved for it, asking the advisor for the
// gang's first pod (and when the reserved nodes are used up or expired).
func (p *Plugin) PreFilter(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodes []fwk.NodeInfo) (*fwk.PreFilterResult, *fwk.Status) {
	domainUID, err := domainOf(pod, p.templates)
	if err != nil {
		return nil, fwk.AsStatus(fmt.Errorf("reading the pod's ResourceClaimTemplates: %w", err))
	}
	if domainUID == "" {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	size, err := gangSize(pod, domainUID, p.domains)
	if err != nil {
		return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, err.Error())
	}
	logger := klog.FromContext(ctx).WithValues("cd_uid", domainUID) // the scheduler names the pod

	p.gangs.Lock()
	defer p.gangs.Unlock()
	p.gangs.ForgetIdle()
	adopting := !p.gangs.Has(domainUID)
	g := p.gangs.Get(domainUID, size)
	if adopting {
		p.adopt(ctx, logger, g, pod, nodes)
	}
	now := p.gangs.Now()
	allowed := g.Free(now)
	if allowed.Len() == 0 {
		if held := g.Held; held != nil {
			// Used up (more pods than the gang's size) or expired: replaced by a new one below.
			g.Held = nil
			go p.releaseQuietly(logger, held.ID)
		}
		if message := g.RecentNoRoom(p.gangs.Now(), noRoomReuse); message != "" {
			p.probeLater(logger, domainUID, pod.Namespace)
			return nil, fwk.NewStatus(fwk.Unschedulable, message)
		}
		candidates := make([]string, 0, len(nodes))
		for _, n := range nodes {
			candidates = append(candidates, n.Node().Name)
		}
		request := gangRequest{
			domainUID:     domainUID,
			numNodes:      g.Wanted(),
			clique:        g.Clique,
			candidates:    candidates,
			excluded:      append(sets.List(g.NodesInUse()), p.gangs.BusyElsewhere(domainUID)...),
			sizeKnown:     g.Size > 0,
			reservationID: g.NextID(p.gangs.Holder),
		}
		held, err := p.advisor.placeAndReserve(ctx, request)
		if err != nil {
			status := p.refusal(logger, domainUID, request, err)
			var noRoom *infeasible
			if errors.As(err, &noRoom) {
				g.RecordNoRoom(p.gangs.Now(), status.Message())
			}
			return nil, status
		}
		g.RecordNoRoom(time.Time{}, "")
		g.Held = held
		if g.Clique == "" {
			g.Clique = held.Clique
		}
		allowed = g.Free(now)
		logger.Info("ComputeDomain gang reserved by the placement advisor",
			"reservation", held.ID, "nodes", held.Nodes, "clique", held.Clique, "gangSize", g.Size)
	}
	state.Write(stateKey, &cycleState{domainUID: domainUID, reservationID: g.Held.ID, allowed: allowed})
	return &fwk.PreFilterResult{NodeNames: allowed.Clone()}, nil
}

// adopt gives a gang the table has just made the pods of it that are bound already. A gang this
// scheduler's earlier run began and did not finish (it restarted) is thereby finished where it
// began: its earlier reservation is released first (Place would count its nodes as taken, and
// the reservation id is the one NextID gives again), and the rest of the gang is asked for
// beside the bound pods, in their clique, without their nodes.
func (p *Plugin) adopt(ctx context.Context, logger klog.Logger, g *gang.Gang, pod *v1.Pod, nodes []fwk.NodeInfo) {
	others, err := p.pods.Pods(pod.Namespace).List(labels.Everything())
	if err != nil {
		logger.Error(err, "listing the namespace's pods to find the gang's bound ones")
		return
	}
	for _, other := range others {
		done := other.Status.Phase == v1.PodSucceeded || other.Status.Phase == v1.PodFailed
		if other.UID == pod.UID || other.Spec.NodeName == "" || other.DeletionTimestamp != nil || done {
			continue
		}
		if uid, err := domainOf(other, p.templates); err == nil && uid == g.DomainUID {
			g.Bind(other.UID, other.Spec.NodeName)
		}
	}
	bound := g.NodesInUse()
	if bound.Len() == 0 {
		return
	}
	for _, n := range nodes {
		if clique := n.Node().Labels[cliqueLabel]; bound.Has(n.Node().Name) && clique != "" {
			g.Clique = clique
			break
		}
	}
	if _, err := p.advisor.release(ctx, g.FirstID(p.gangs.Holder)); err != nil {
		logger.Error(err, "releasing the earlier run's reservation failed (its TTL frees it)")
	}
	logger.Info("ComputeDomain gang adopted: pods of it were bound before this scheduler started",
		"boundNodes", sets.List(bound), "clique", g.Clique)
}

// refusal turns an advisor failure into the pod's status: unreachable = an error (the pod is
// retried with backoff, as the advisor may be back any moment); no room = unschedulable.
func (p *Plugin) refusal(logger klog.Logger, domainUID string, request gangRequest, err error) *fwk.Status {
	var noRoom *infeasible
	var wrong *refused
	switch {
	case errors.As(err, &wrong):
		return fwk.NewStatus(fwk.UnschedulableAndUnresolvable, fmt.Sprintf("ComputeDomain %s: %s", domainUID, wrong))
	case errors.As(err, &noRoom):
		where := "one NVLink clique"
		if request.clique != "" {
			where = "clique " + request.clique
		}
		return fwk.NewStatus(fwk.Unschedulable, fmt.Sprintf(
			"placement advisor: no room for %d node(s) of ComputeDomain %s in %s: %s",
			request.numNodes, domainUID, where, err))
	case errors.Is(err, errUnavailable):
		logger.Info("placement advisor unavailable; the gang waits", "err", err)
		return fwk.AsStatus(fmt.Errorf("ComputeDomain %s waits for the placement advisor (nothing reserved, nothing bound): %w", domainUID, err))
	default:
		return fwk.AsStatus(fmt.Errorf("ComputeDomain %s: %w", domainUID, err))
	}
}

// PreFilterExtensions implements fwk.PreFilterPlugin (no incremental updates needed).
func (p *Plugin) PreFilterExtensions() fwk.PreFilterExtensions { return nil }

// Filter keeps only the nodes reserved for the pod's gang.
func (p *Plugin) Filter(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeInfo fwk.NodeInfo) *fwk.Status {
	s, err := readState(state)
	if err != nil {
		return fwk.AsStatus(err)
	}
	if !s.allowed.Has(nodeInfo.Node().Name) {
		return fwk.NewStatus(fwk.UnschedulableAndUnresolvable, fmt.Sprintf(
			"node is not among those the placement advisor reserved for ComputeDomain %s (reservation %s)", s.domainUID, s.reservationID))
	}
	return nil
}

// PreScore skips Score for pods of no ComputeDomain.
func (p *Plugin) PreScore(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodes []fwk.NodeInfo) *fwk.Status {
	if _, err := readState(state); err != nil {
		return fwk.NewStatus(fwk.Skip)
	}
	return nil
}

// Score ranks the gang's reserved nodes first.
func (p *Plugin) Score(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeInfo fwk.NodeInfo) (int64, *fwk.Status) {
	s, err := readState(state)
	if err != nil {
		return 0, fwk.AsStatus(err)
	}
	if s.allowed.Has(nodeInfo.Node().Name) {
		return fwk.MaxNodeScore, nil
	}
	return 0, nil
}

// ScoreExtensions implements fwk.ScorePlugin (scores are already in range).
func (p *Plugin) ScoreExtensions() fwk.ScoreExtensions { return nil }

// Reserve records the node the pod is assumed on, so the gang's next pod takes another, and
// has the gang's pending pods tried next.
func (p *Plugin) Reserve(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) *fwk.Status {
	s, err := readState(state)
	if err != nil {
		return nil // not ours
	}
	p.gangs.Lock()
	defer p.gangs.Unlock()
	g := p.gangs.Get(s.domainUID, 0)
	g.Assume(pod.UID, nodeName)
	if pod.Spec.SchedulingGroup == nil && !g.Whole() {
		p.activateSiblings(klog.FromContext(ctx).WithValues("cd_uid", s.domainUID), state, g, pod.Namespace)
	}
	return nil
}

// Unreserve forgets the node of a pod that did not bind; a pod rejected while it waited for
// its gang takes the gang's other waiting pods and its reservation with it.
func (p *Plugin) Unreserve(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) {
	s, err := readState(state)
	if err != nil {
		return
	}
	p.gangs.Lock()
	g := p.gangs.Get(s.domainUID, 0)
	g.Unassume(pod.UID)
	others, drop, gaveUp := g.GiveUp(pod.UID)
	p.gangs.Unlock()
	if gaveUp {
		p.abandon(ctx, klog.FromContext(ctx).WithValues("cd_uid", s.domainUID), s.domainUID, pod, others, drop)
	}
}

// PostBind marks the pod bound and releases the reservation once every reserved node has a
// bound pod of the gang (from then on the pods' claims hold the nodes).
func (p *Plugin) PostBind(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) {
	s, err := readState(state)
	if err != nil {
		return
	}
	logger := klog.FromContext(ctx).WithValues("cd_uid", s.domainUID)
	p.gangs.Lock()
	g := p.gangs.Get(s.domainUID, 0)
	g.Bind(pod.UID, nodeName)
	var done *gang.Reservation
	if g.Served() {
		done, g.Held = g.Held, nil
	}
	p.gangs.Unlock()
	if done != nil {
		released, err := p.advisor.release(ctx, done.ID)
		if err != nil {
			// Its TTL frees the nodes anyway.
			logger.Error(err, "releasing the gang's reservation failed", "reservation", done.ID)
			return
		}
		logger.Info("ComputeDomain gang bound; reservation released", "reservation", done.ID, "released", released, "nodes", done.Nodes)
	}
}

func (p *Plugin) releaseQuietly(logger klog.Logger, id string) {
	if _, err := p.advisor.release(context.Background(), id); err != nil {
		logger.Error(err, "releasing a used-up reservation failed (its TTL frees it)", "reservation", id)
	}
}

func readState(state fwk.CycleState) (*cycleState, error) {
	data, err := state.Read(stateKey)
	if err != nil {
		return nil, err
	}
	s, ok := data.(*cycleState)
	if !ok {
		return nil, fmt.Errorf("%s: unexpected cycle state %T", Name, data)
	}
	return s, nil
}
