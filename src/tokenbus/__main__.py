import sys

from tokenbus.cli.main import main

sys.exit(main())
