import sys

from broker.app.cli import main

sys.exit(main())
