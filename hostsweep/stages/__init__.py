"""stages: the data flow wired end to end, one module per `stage=` of the main command.
The only package that may import every other one; __main__ picks the stage.
"""
