import sys

from ragen.cli import main

sys.exit(main())
