"""fnkernel on Kubernetes (docs/kubernetes.md): Runs as objects of our ``Run`` custom resource,
Runtime Pods as pods, read and written through the official ``kubernetes`` client.

``objects`` says how a Run and a Runtime Pod look as Kubernetes objects; ``store`` is the
``RunStore`` over the API server; ``provisioner`` the ``PodProvisioner`` of Runtime Pods. Nothing outside this package imports the client, and the
kernel imports none of it.
"""
