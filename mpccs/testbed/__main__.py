import sys

from mpccs.testbed.cli import main

sys.exit(main())
