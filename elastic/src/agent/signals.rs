//! SIGTERM, SIGINT and SIGHUP to the agent become events of its monitor loop, so they can be
//! forwarded to the workers with the grace period (spot preemption gives a SIGTERM and tens
//! of seconds before the machine goes).

use std::sync::mpsc::Sender;

use super::events::Event;

/// Starts a thread that turns the signals into [`Event::Signal`]s on `events`. Installing
/// the handlers is process-wide and lasts for the life of the process.
pub(crate) fn forward_signals(events: Sender<Event>) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Register before returning so that a signal right after `run` starts is not lost.
    let (mut term, mut int, mut hup) = {
        let _guard = rt.enter();
        (
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
            signal(SignalKind::hangup())?,
        )
    };
    std::thread::Builder::new()
        .name("rekindle-signals".into())
        .spawn(move || {
            rt.block_on(async move {
                loop {
                    let s = tokio::select! {
                        _ = term.recv() => libc::SIGTERM,
                        _ = int.recv() => libc::SIGINT,
                        _ = hup.recv() => libc::SIGHUP,
                    };
                    if events.send(Event::Signal(s)).is_err() {
                        return;
                    }
                }
            })
        })?;
    Ok(())
}
