"""``python -m fnkernel.kernel -f CONNECTION_FILE``: what the fnkernel kernelspec runs."""

from fnkernel.kernel.kernel import FnKernel, FnKernelApp

if __name__ == "__main__":
    FnKernelApp.launch_instance(kernel_class=FnKernel)
