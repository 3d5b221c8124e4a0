from exl3cli.cli import main

main()
