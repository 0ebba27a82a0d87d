"""fnkernel on Kubernetes (docs/kubernetes.md): Runs as objects of our ``Run`` custom resource,
Runtime Pods as pods, read and written through the official ``kubernetes`` client.

``objects`` says how a Run and a Runtime Pod look as Kubernetes objects; ``store`` is the
``RunStore`` over the API server. Runtime Pods are the pods of deploy/'s Deployments, which no
component creates or deletes (docs/kubernetes.md, "Runtime Pods"). Nothing outside this package
imports the client, and the kernel imports none of it.
"""
