import sys

from patchplace.research.recipes import main

sys.exit(main())
