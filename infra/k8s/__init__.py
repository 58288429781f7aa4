"""Kubernetes templates of Crucible (rendered by `python -m infra.k8s.render`)."""
