import sys

from reslab.orchestrator.cli import main

sys.exit(main())
