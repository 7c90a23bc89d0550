import sys

from featcal.cli.main import main

sys.exit(main())
