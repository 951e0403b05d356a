"""Suite-wide plugins: the real Kubernetes test cluster (tests/k8s) for any test that asks for `k8s_cluster`."""

pytest_plugins = ["tests.k8s.fixtures"]
