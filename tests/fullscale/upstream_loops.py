"""Small faithful excerpts of the training loops the probe runs under, for
tests/fullscale/loops_worker.py: the control flow of each loop around train_step (skip list,
train_step's return values, checkpoint-and-exit, iteration / sample counters), upstream lines
kept as they are, everything else (timers, logging, evaluation, profiling, GC, CUDA graphs,
fault tolerance) elided where marked. The names they use (get_args-style `args`, mpu,
get_num_microbatches, train_step, dummy_train_step, save_checkpoint_and_time) are this
module's globals, set by the worker the way the upstream modules import them.

Sources:
- train_mindspeed_llm: Ascend/MindSpeed-LLM, mindspeed_llm/training/training.py, train(),
  commit c77308a14bfcb1aa7ca61da9c1aa24a893cb1b91 (master, 2026), lines 587-840; the same
  control flow in tags v2.2.0 (53f3639c, line 642) and v26.0.0 (57c33296, line 660).
- train_megatron_0_12: NVIDIA/Megatron-LM, megatron/training/training.py, train(), tag
  core_v0.12.1 (a845aa7e12b3a117e24c2352b9e3e60bad2e3a17), lines 1965-2007 and 2121-2132;
  core_v0.13.0 .. core_v0.16.0 have the same `iteration in args.iterations_to_skip` test.
- train_megatron_0_17: the same file at core_v0.17.0 (9539a12e1b04a68423f57b3eb41d6125161dca24),
  line 2966: `(iteration + 1) in args.iterations_to_skip` (commit b4e4d9618e).
- train_modellink_2024: Ascend/MindSpeed-LLM (then ModelLink), modellink/training.py, train(),
  commit 0df09cd187b1a8d8e611b5d4fcbcf6459da11ef7 (2024-03, the seed's stack), lines 110-200:
  train_step returns 4 values, no skip list, no rerun machine.
- train_megatron_0_16: megatron/training/training.py at core_v0.16.0
  (3bec9aa97dda898d16ff5a89bac0ed2b6682b172), lines 2752-2810: 0-based skip, 8 values.
- dummy_train_step and train_step: megatron/training/training.py, core_v0.12.1, lines
  1204-1252 and 1265-1290 (the rerun state machine's loop and early exit; the optimizer
  step and the lr schedule step), with megatron.core's real rerun state machine.
"""

import sys

# set by the worker (the upstream modules' imports)
args = mpu = get_num_microbatches = get_forward_backward_func = None
get_rerun_state_machine = None
save_checkpoint_and_time = None     # the loop module's save (records the iteration here)
SEQ, MBS = 16, 2


def train_mindspeed_llm(forward_step_func, model, optimizer, opt_param_scheduler,
                        train_data_iterator, valid_data_iterator, process_non_loss_data_func, config):
    """Train the model function."""
    # ... (elided: tensorboard args, model.train(), one-logger, config hooks, timers, gc)
    iteration = args.iteration
    num_floating_point_operations_so_far = 0
    start_iteration = iteration
    while iteration < args.train_iters:
        # ... (elided: async save finalisation, microbatch rampup checkpoint)
        args.curr_iteration = iteration
        loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad = \
            train_step(forward_step_func,
                       train_data_iterator,
                       model,
                       optimizer,
                       opt_param_scheduler,
                       config)
        # ... (elided: forward pre-hook enabling at start_iteration)
        iteration += 1
        batch_size = mpu.get_data_parallel_world_size() * \
                     args.micro_batch_size * \
                     get_num_microbatches()
        args.consumed_train_samples += batch_size
        # ... (elided: flops, training_log, autoresume, evaluation, signal handler)
        if args.save and args.save_interval and \
                iteration % args.save_interval == 0:
            save_checkpoint_and_time(iteration, model, optimizer,
                                     opt_param_scheduler,
                                     num_floating_point_operations_so_far,
                                     checkpointing_context=None)
        # ... (elided: exit-interval / exit-duration checks)
    return iteration, num_floating_point_operations_so_far


def train_megatron_0_12(forward_step_func, model, optimizer, opt_param_scheduler,
                        train_data_iterator, valid_data_iterator, process_non_loss_data_func, config,
                        checkpointing_context=None):
    """Train the model function."""
    iteration = args.iteration
    num_floating_point_operations_so_far = args.num_floating_point_operations_so_far
    start_iteration = iteration
    should_exit = False
    exit_code = 0
    while iteration < args.train_iters:
        # ... (elided: profiling, async save, microbatch rampup)
        # Completely skip iteration if needed.
        if iteration in args.iterations_to_skip:
            # Dummy train_step to fast forward train_data_iterator.
            dummy_train_step(train_data_iterator)
            iteration += 1
            batch_size = mpu.get_data_parallel_world_size() * \
                         args.micro_batch_size * \
                         get_num_microbatches()
            args.consumed_train_samples += batch_size
            args.skipped_train_samples += batch_size
            continue

        # Run training step.
        args.curr_iteration = iteration
        loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad = \
            train_step(forward_step_func,
                       train_data_iterator,
                       model,
                       optimizer,
                       opt_param_scheduler,
                       config)
        if should_checkpoint:
            save_checkpoint_and_time(iteration, model, optimizer,
                                     opt_param_scheduler,
                                     num_floating_point_operations_so_far,
                                     checkpointing_context, train_data_iterator=train_data_iterator)
        if should_exit:
            break
        # ... (elided: forward pre-hooks)
        iteration += 1
        batch_size = mpu.get_data_parallel_world_size() * \
                     args.micro_batch_size * \
                     get_num_microbatches()
        args.consumed_train_samples += batch_size
        # ... (elided: logging, evaluation, checkpoint_and_decide_exit)
    # If any exit conditions (signal handler, duration, iterations) have been reached, exit.
    if should_exit:
        # ... (elided: wandb, fault tolerance shutdown)
        sys.exit(exit_code)
    return iteration, num_floating_point_operations_so_far


def train_megatron_0_17(forward_step_func, model, optimizer, opt_param_scheduler,
                        train_data_iterator, valid_data_iterator, process_non_loss_data_func, config,
                        checkpointing_context=None):
    """Train the model function."""
    iteration = args.iteration
    num_floating_point_operations_so_far = args.num_floating_point_operations_so_far
    start_iteration = iteration
    should_exit = False
    exit_code = 0
    while iteration < args.train_iters:
        # Completely skip iteration if needed.
        if (iteration + 1) in args.iterations_to_skip:
            # Dummy train_step to fast forward train_data_iterator.
            dummy_train_step(train_data_iterator)
            if iteration == start_iteration:
                start_iteration = iteration + 1
            iteration += 1
            batch_size = (
                mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
            )
            args.consumed_train_samples += batch_size
            args.skipped_train_samples += batch_size
            continue

        args.curr_iteration = iteration
        (
            loss_dict,
            skipped_iter,
            should_checkpoint,
            should_exit,
            exit_code,
            grad_norm,
            num_zeros_in_grad,
            max_attention_logit,
        ) = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config
        )
        if should_checkpoint:
            save_checkpoint_and_time(
                iteration,
                model,
                optimizer,
                opt_param_scheduler,
                num_floating_point_operations_so_far,
                checkpointing_context,
                train_data_iterator=train_data_iterator,
            )
        if should_exit:
            break
        iteration += 1
        batch_size = (
            mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
        )
        args.consumed_train_samples += batch_size
    if should_exit:
        sys.exit(exit_code)
    return iteration, num_floating_point_operations_so_far


def train_modellink_2024(forward_step_func, model, optimizer, opt_param_scheduler,
                         train_data_iterator, valid_data_iterator, process_non_loss_data_func, config):
    """Train the model function."""
    # ... (elided: tensorboard args, model.train(), config hooks, timers, gc, profiler)
    iteration = args.iteration
    while iteration < args.train_iters:
        # ... (elided: update_num_microbatches)
        args.curr_iteration = iteration
        loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = \
            train_step(forward_step_func,
                       train_data_iterator,
                       model,
                       optimizer,
                       opt_param_scheduler,
                       config)
        iteration += 1
        args.consumed_train_samples += mpu.get_data_parallel_world_size() * \
                                       args.micro_batch_size * \
                                       get_num_microbatches()
        # ... (elided: training_log, autoresume, evaluation, checkpointing, exit checks)
    return iteration


def train_megatron_0_16(forward_step_func, model, optimizer, opt_param_scheduler,
                        train_data_iterator, valid_data_iterator, process_non_loss_data_func, config,
                        checkpointing_context=None):
    """Train the model function."""
    iteration = args.iteration
    num_floating_point_operations_so_far = args.num_floating_point_operations_so_far
    start_iteration = iteration
    should_exit = False
    exit_code = 0
    while iteration < args.train_iters:
        # Completely skip iteration if needed.
        if iteration in args.iterations_to_skip:
            # Dummy train_step to fast forward train_data_iterator.
            dummy_train_step(train_data_iterator)
            if iteration == start_iteration:
                start_iteration = iteration + 1
            iteration += 1
            batch_size = (
                mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
            )
            args.consumed_train_samples += batch_size
            args.skipped_train_samples += batch_size
            continue

        args.curr_iteration = iteration
        # ... (elided: GRPO / RL data)
        (
            loss_dict,
            skipped_iter,
            should_checkpoint,
            should_exit,
            exit_code,
            grad_norm,
            num_zeros_in_grad,
            max_attention_logit,
        ) = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config
        )
        if should_checkpoint:
            save_checkpoint_and_time(
                iteration,
                model,
                optimizer,
                opt_param_scheduler,
                num_floating_point_operations_so_far,
                checkpointing_context,
                train_data_iterator=train_data_iterator,
            )
        if should_exit:
            break
        iteration += 1
        batch_size = (
            mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
        )
        args.consumed_train_samples += batch_size
    if should_exit:
        sys.exit(exit_code)
    return iteration, num_floating_point_operations_so_far


def dummy_train_step(data_iterator):
    """Single dummy training step."""
    num_microbatches = get_num_microbatches()
    for _ in range(num_microbatches):
        # Re-use methods used in get_batch() from pretrain_{gpt, mamba}.py.
        # (here: the batch is one next(); get_batch_on_this_tp_rank draws it on TP rank 0)
        next(data_iterator)


def make_train_step(returns):
    """Megatron's train_step (core_v0.12.1) returning `returns` values (7; core_v0.16+: 8)."""

    def train_step(forward_step_func, data_iterator,
                   model, optimizer, opt_param_scheduler, config):
        """Single training step."""
        rerun_state_machine = get_rerun_state_machine()
        while rerun_state_machine.should_run_forward_backward(data_iterator):
            # Set grad to zero.
            for model_chunk in model:
                model_chunk.zero_grad_buffer()
            optimizer.zero_grad()

            # Forward pass.
            forward_backward_func = get_forward_backward_func()
            losses_reduced = forward_backward_func(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=get_num_microbatches(),
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=False)
        should_checkpoint, should_exit, exit_code = rerun_state_machine.should_checkpoint_and_exit()
        if should_exit:
            return ({}, True, should_checkpoint, should_exit, exit_code) + (None,) * (returns - 5)

        # Update parameters.
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
        # Update learning rate.
        if update_successful:
            opt_param_scheduler.step(increment=get_num_microbatches() * MBS * args.data_parallel_size)
            skipped_iter = 0
        else:
            skipped_iter = 1
        # ... (elided: loss averaging over micro batches on the last stage)
        v = sum(float(x["lm loss"]) for x in losses_reduced) / max(len(losses_reduced), 1)
        return ({"lm loss": v}, skipped_iter, False, False, 0, grad_norm,
                num_zeros_in_grad) + (None,) * (returns - 7)

    return train_step


def train_step_modellink_2024(forward_step_func, data_iterator,
                              model, optimizer, opt_param_scheduler, config):
    """Single training step (ModelLink 2024's Megatron copy, megatron/training.py at 0df09cd1,
    lines 431-500: no rerun machine, 4 values)."""
    # Set grad to zero.
    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # Forward pass.
    forward_backward_func = get_forward_backward_func()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=get_num_microbatches(), seq_length=SEQ, micro_batch_size=MBS,
        forward_only=False)
    # Update parameters.
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    # Update learning rate.
    if update_successful:
        opt_param_scheduler.step(increment=get_num_microbatches() * MBS * args.data_parallel_size)
        skipped_iter = 0
    else:
        skipped_iter = 1
    v = sum(float(x["lm loss"]) for x in losses_reduced) / max(len(losses_reduced), 1)
    return {"lm loss": v}, skipped_iter, grad_norm, num_zeros_in_grad


train_step = None   # the worker sets make_train_step(...), wrapped by the probe or not
