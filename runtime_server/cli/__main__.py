import sys

from runtime_server.cli import main

sys.exit(main())
