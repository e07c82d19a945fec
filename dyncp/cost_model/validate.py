"""Former home of ``python -m dyncp.profiling.validate`` (it imports torch, so it moved out of
the torch-free cost model); kept so that ``python -m dyncp.cost_model.validate`` still runs."""

from dyncp.profiling.validate import main

if __name__ == "__main__":
    main()
