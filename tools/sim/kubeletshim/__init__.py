"""A kubelet stand-in for simulated GPU nodes on a real Kubernetes control plane.

One process plays the kubelet of many nodes (one asyncio task group per node): it registers and
heartbeats the Node, registers our DRA plugin through its registration socket, prepares the
resource claims of pods bound to the node through the plugin's DRA socket (retrying failures and
reporting them as pod Events, as kubelet does), marks the pods Running, and on deletion
unprepares their claims and removes them. There are no containers.

    python -m tools.sim.kubeletshim --kubeconfig KUBECONFIG --nodes-file nodes.json
"""
