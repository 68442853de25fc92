from dvfs.cli import main

main()
