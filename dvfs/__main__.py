from dvfs.launch import main

main()
