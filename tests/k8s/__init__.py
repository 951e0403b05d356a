"""A real Kubernetes control plane and a test node agent for end-to-end tests (see cluster.py)."""
