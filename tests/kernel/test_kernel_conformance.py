"""The Jupyter messaging conformance suite (jupyter_kernel_test) against the installed fnkernel
kernelspec: the kernel speaks the protocol exactly as stock ipykernel does (history "range" is
omitted, as it is for ipykernel)."""

from __future__ import annotations

import unittest

import jupyter_kernel_test
import pytest

from fnkernel.kernel.kernel import KERNEL_NAME


@pytest.mark.usefixtures("fnkernel_spec")
class FnKernelConformance(jupyter_kernel_test.KernelTests):
    kernel_name = KERNEL_NAME
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [
        {"text": "zi", "matches": {"zip"}},
        {"text": "%fn_tr", "matches": {"%fn_trace"}},
    ]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "zip?"
    code_generate_error = "raise ValueError('x')"
    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data = [
        {
            "code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
            "mime": "text/html",
        },
        {
            "code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
            "mime": "text/latex",
        },
    ]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"


if __name__ == "__main__":
    unittest.main()
