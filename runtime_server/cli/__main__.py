import sys

from fnkernel.runtime_server.cli import main

sys.exit(main())
