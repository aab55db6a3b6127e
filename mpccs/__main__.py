"""``python -m mpccs -n N prog args...`` is ``mpccs-run``."""
import sys

from .launch import main

sys.exit(main())
