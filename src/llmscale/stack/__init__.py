"""What a training stack does, torch-free: the software half of a plan's cost.

A *stack* is one training software's behaviour (kernels, what each recompute policy saves, when
parameters are gathered and gradients reduced, which traffic overlaps compute, its per-step
overheads), kept apart from the model (shape), the system (GPUs and links, rates measured on
bare hardware) and the layout (tp, pp, dp, micro-batch, schedule). The planner reads a stack;
the llmscale runtime is one stack among them and reads its own rules from here.
"""
