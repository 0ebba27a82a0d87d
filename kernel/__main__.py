"""``python -m fnkernel.kernel -f CONNECTION_FILE``: what the fnkernel kernelspec runs."""

from ipykernel.kernelapp import IPKernelApp

from fnkernel.kernel.kernel import FnKernel

if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=FnKernel)
