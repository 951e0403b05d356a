"""A real Kubernetes control plane and a real node (kubelet, containerd) for end-to-end tests (see cluster.py)."""
