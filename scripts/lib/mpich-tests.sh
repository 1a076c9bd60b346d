# What the second MPI's pass of scripts/test.sh runs of each test binary. Sourced by test.sh.
#
# Open MPI's pass runs every test. MPICH's runs the tests whose outcome can depend on the MPI
# library: its launcher (Hydra, srun --mpi=pmi2), its aborts, signals and exit codes, its
# progress engine and thread support, its shared-memory windows, its own collectives as the
# reference, and every layout pair of the compatibility table (tests/conformance.rs trains each
# unordered pair of layouts once under MPICH and refuses each refused pair). Left to Open MPI's pass: what a
# layout's arithmetic, a file format or a report does, which no MPI call changes and which the
# conformance matrix's MPICH walk trains once per layout anyway. CI has 40 minutes on 2 cores
# for set-up, both builds and both passes.
#
# mpich_test_args NAME: prints the arguments NAME's test binary runs with under MPICH (empty:
# all of it), or returns 1 when MPICH's pass leaves the whole binary to Open MPI's, or 2 when
# this table does not know NAME (a new tests/NAME.rs must say here what MPICH runs of it).
mpich_test_args() {
    case "$1" in
        # Launchers, aborts, signals, exit codes, MPI_Abort's reach and the watchdog's: all of
        # these differ between Hydra and Open MPI's launcher.
        mpi_library|cluster|slurm) ;;
        # One line from one rank and every rank non-zero, under Hydra: for a command line that
        # does not parse, an error found before MPI starts, one agreed after it, a study's, and
        # the inputs that could hang a rank. Not the other kinds' launches (what an option's or
        # a file's check says does not depend on the library; the values each check refuses are
        # unit tests).
        bad_input)
            echo --exact missing_and_unreadable_files bad_options options_the_strategy_does_not_read_are_refused \
                a_strong_study_whose_batch_does_not_split_at_a_point_stops_before_it_starts \
                threads_far_beyond_the_cores_are_refused a_fifo_as_data_is_refused_at_once ;;
        # Signals, kills, aborts, watchdogs, threads at finalize, stalls and start-up. Not what
        # a checkpoint folder, a full disk or a deferred check decides, which is file logic and
        # arithmetic, nor each layout kind's fault hooks (the conformance matrix faults them
        # under MPICH).
        reliability)
            echo --skip a_damaged_checkpoint_is_skipped_for_the_previous_one \
                --skip checkpoints_of_another_run_are_refused_or_accepted_with_reason \
                --skip resume_without_a_checkpoint_starts_from_the_beginning \
                --skip resuming_a_finished_run_ends_at_once_without_a_record \
                --skip rhd_and_auto_continue_a_ring_checkpoint \
                --skip resume_refuses_another_dataset_of_the_same_size_and_an_edited_meta_json \
                --skip outputs_on_a_full_disk_leave_no_temporary_file \
                --skip a_profile_on_a_full_disk_fails_the_run_and_leaves_nothing \
                --skip a_diverged_step_writes_no_checkpoint \
                --skip checks_read_late_give_the_same_weights_and_errors_as_every_step \
                --skip every_step_kind_honours_the_injected_faults ;;
        # Every unordered layout pair against one process, under MPICH's own messages, and one
        # refused launch of each kind.
        conformance) ;;
        # The parameter server's matching of any-source messages and its servers' threads.
        ps) ;;
        # The hand-written collectives against MPICH's MPI_Allreduce, node detection, and MPICH's
        # shared-memory windows. Not the same sums trained end to end (the conformance matrix
        # trains ring, rhd and auto under MPICH), the bench's record files and its own check of
        # a wrong sum, one rank's empty exchange, nor the staged (GPU-shaped) copies, which call
        # no MPI of their own.
        exchange)
            echo --skip ring_trains_to_the_same_weights_as_allreduce \
                --skip rhd_and_auto_train_to_the_same_weights_as_allreduce \
                --skip bench_rows_are_recorded --skip bench_rounds_pool_into_one_row_per_strategy_and_size \
                --skip the_bench_catches_a_wrong_sum \
                --skip one_rank_exchanges_nothing --skip staged ;;
        # Messages that wait for their sender (the progress thread under MPI_THREAD_MULTIPLE),
        # and ZB-V's turn of a stage to itself, which the conformance matrix leaves to this file.
        pipeline)
            echo --exact stages_whose_messages_wait_for_their_sender_run_a_progress_thread \
                zero_bubble_schedules_train_the_weights_of_one_process ;;
        # The background thread's sums against MPICH's MPI_Allreduce, and its stall check, which
        # waits on a rank's messages through MPICH's progress.
        horovod)
            echo --exact sums_equal_mpi_allreduce_per_tensor a_stall_is_reported_with_the_missing_rank ;;
        # Layout arithmetic (the conformance matrix trains each under MPICH), training's
        # sampling, learning and memory, checkpoint files, precision, optimizers, data, reports,
        # projections, presets and run files, the source's layout and its documentation's links,
        # GPU identities, and set-up (tests/install.rs loads Open MPI from a module).
        training|checkpoint|fsdp|zero|tensor|recipe|overlap|precision|preset|run_file|gpu|optim_pytorch|datasets|report|projection|architecture|install|docs)
            return 1 ;;
        *) return 2 ;;
    esac
}
