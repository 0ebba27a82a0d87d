"""What the operating system gives every part of fnkernel, under all the others (docs/architecture.md,
"Layers"): ``procfs`` (what /proc says about a process) and ``private`` (directories and files
only this user may touch). Standard library only: the client library uses them at kernel start.
"""
