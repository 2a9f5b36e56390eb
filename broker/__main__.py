import sys

from broker.runtime.cli import main

sys.exit(main())
