package placement

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"

	"computedomains/integrations/scheduler-plugin/gang"
)

// How long a gang's held pods wait with no sibling left pending before they may bind anyway:
// the workload has fewer pods than the gang's size (a Job run with less parallelism). Long
// enough for a Job controller's next batch of pods to appear.
const settleAfter = 3 * time.Second

// How long the advisor's answer that a gang does not fit serves the gang's other pods (each is
// retried on every cluster event) before one of them asks again.
const noRoomReuse = time.Second

// Permit holds each pod of a gang of known size until every pod of the gang is assumed (or
// bound), then lets them all bind at once, so that no part of a gang holds nodes while the
// rest waits. Pods of a PodGroup are left to kube-scheduler's own gang scheduling.
func (p *Plugin) Permit(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) (*fwk.Status, time.Duration) {
	s, err := readState(state)
	if err != nil || pod.Spec.SchedulingGroup != nil {
		return nil, 0
	}
	p.gangs.Lock()
	defer p.gangs.Unlock()
	g := p.gangs.Get(s.domainUID, 0)
	if g.Size == 0 {
		return nil, 0 // no size: the gang grows one node at a time, nothing to wait for
	}
	if g.Whole() {
		p.letWaiting(klog.FromContext(ctx).WithValues("cd_uid", s.domainUID), g, "every pod of the gang is assumed")
		return nil, 0
	}
	g.Hold(pod.UID)
	p.settleLater(s.domainUID, pod.Namespace)
	return fwk.NewStatus(fwk.Wait, fmt.Sprintf(
		"ComputeDomain %s: waiting until all %d pods of the gang are scheduled", s.domainUID, g.Size)), p.gangWait
}

// letWaiting allows the gang's held pods to bind. A held pod not yet in the framework's waiting
// map (its Permit has only just returned) stays held for the next settle tick. Call with the
// table locked.
func (p *Plugin) letWaiting(logger klog.Logger, g *gang.Gang, why string) {
	held := g.Waiting()
	if len(held) == 0 {
		return
	}
	let := 0
	for _, uid := range held {
		if waiting := p.handle.GetWaitingPod(uid); waiting != nil {
			waiting.Allow(Name)
			g.Let(uid)
			let++
		}
	}
	logger.Info("ComputeDomain gang released from its wait; its pods bind", "reason", why, "pods", let, "gangSize", g.Size)
}

// settleLater checks the gang again after settleAfter (once per gang at a time): its held pods
// bind when the gang is whole or none of its pods is left pending.
func (p *Plugin) settleLater(domainUID, namespace string) {
	if p.settling.Has(domainUID) {
		return
	}
	p.settling.Insert(domainUID)
	time.AfterFunc(settleAfter, func() { p.settle(domainUID, namespace) })
}

func (p *Plugin) settle(domainUID, namespace string) {
	p.gangs.Lock()
	defer p.gangs.Unlock()
	p.settling.Delete(domainUID)
	if !p.gangs.Has(domainUID) {
		return
	}
	g := p.gangs.Get(domainUID, 0)
	if len(g.Waiting()) == 0 {
		return
	}
	logger := p.logger.WithValues("cd_uid", domainUID)
	switch pending, err := p.siblings(g, namespace); {
	case err != nil:
		logger.Error(err, "listing the gang's pending pods")
	case g.Whole():
		p.letWaiting(logger, g, "every pod of the gang is assumed")
	case len(pending) == 0:
		p.letWaiting(logger, g, "no pod of the gang is left pending (the workload has fewer pods than the gang's size)")
	}
	if len(g.Waiting()) > 0 {
		p.settleLater(domainUID, namespace)
	}
}

// siblings are the gang's pods still to be scheduled (in the pod lister): neither assumed nor
// bound, nor finished or going. Call with the table locked.
func (p *Plugin) siblings(g *gang.Gang, namespace string) ([]*v1.Pod, error) {
	all, err := p.pods.Pods(namespace).List(labels.Everything())
	if err != nil {
		return nil, err
	}
	var out []*v1.Pod
	for _, pod := range all {
		done := pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed
		if done || pod.Spec.NodeName != "" || pod.DeletionTimestamp != nil || g.Has(pod.UID) {
			continue
		}
		if uid, err := domainOf(pod, p.templates); err == nil && uid == g.DomainUID {
			out = append(out, pod)
		}
	}
	return out, nil
}

// activateSiblings moves the gang's pending pods to the scheduler's active queue at the end of
// this pod's scheduling cycle, past their backoff or the unschedulable pool: the gang now has
// nodes reserved, and its pods need no cluster event to use them. Call with the table locked.
func (p *Plugin) activateSiblings(logger klog.Logger, state fwk.CycleState, g *gang.Gang, namespace string) {
	data, err := state.Read(framework.PodsToActivateKey)
	if err != nil {
		return
	}
	toActivate, ok := data.(*framework.PodsToActivate)
	if !ok {
		return
	}
	pods, err := p.siblings(g, namespace)
	if err != nil {
		logger.Error(err, "listing the gang's pending pods to activate them")
		return
	}
	toActivate.Lock()
	defer toActivate.Unlock()
	for _, pod := range pods {
		toActivate.Map[klog.KObj(pod).String()] = pod
	}
}

// abandon finishes what the table's GiveUp decided when one of a gang's held pods was rejected
// (its wait timed out, or it failed): the other held pods are rejected too, and the reservation
// is released when no pod of the gang is bound, so the gang starts over as a whole rather than
// holding nodes in part. Call without the table's lock (the rejected pods' Unreserve takes it).
func (p *Plugin) abandon(ctx context.Context, logger klog.Logger, domainUID string, pod *v1.Pod, others []types.UID, drop *gang.Reservation) {
	msg := fmt.Sprintf("ComputeDomain %s: pod %s of the gang was rejected before the whole gang was scheduled (waits up to %s); the gang starts over",
		domainUID, klog.KObj(pod), p.gangWait)
	for _, uid := range others {
		if waiting := p.handle.GetWaitingPod(uid); waiting != nil {
			waiting.Reject(Name, msg)
		}
	}
	released := false
	if drop != nil {
		var err error
		if released, err = p.advisor.release(ctx, drop.ID); err != nil {
			logger.Error(err, "releasing the reservation of a gang that was not whole failed (its TTL frees it)", "reservation", drop.ID)
		}
	}
	logger.Info("ComputeDomain gang not whole in time: its waiting pods rejected, the gang starts over",
		"pod", klog.KObj(pod), "rejected", len(others), "reservationReleased", released)
}

// probeLater has one pending pod of the gang tried again when its "no room" answer goes stale
// (once per gang at a time), so the gang asks the advisor again even if no cluster event comes.
// Call with the table locked.
func (p *Plugin) probeLater(logger klog.Logger, domainUID, namespace string) {
	if p.probing.Has(domainUID) {
		return
	}
	p.probing.Insert(domainUID)
	time.AfterFunc(noRoomReuse, func() {
		p.gangs.Lock()
		p.probing.Delete(domainUID)
		var pending []*v1.Pod
		if p.gangs.Has(domainUID) {
			var err error
			if pending, err = p.siblings(p.gangs.Get(domainUID, 0), namespace); err != nil {
				logger.Error(err, "listing the gang's pending pods to try one again")
			}
		}
		p.gangs.Unlock()
		if len(pending) > 0 {
			p.handle.Activate(logger, map[string]*v1.Pod{klog.KObj(pending[0]).String(): pending[0]})
		}
	})
}
