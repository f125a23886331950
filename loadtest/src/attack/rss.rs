//! A process's resident set (`VmRSS` in `/proc/<pid>/status`), read once
//! or sampled on a thread of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// The resident set of process `pid` in bytes; `None` once it has exited
/// (or on a system without `/proc`).
pub fn rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    vm_rss(&status)
}

/// `VmRSS` of a `/proc/<pid>/status` text, in bytes.
fn vm_rss(status: &str) -> Option<u64> {
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Samples a process's resident set every `every` on a thread of its own
/// until dropped; [`RssWatch::max`] is the highest seen.
#[derive(Debug)]
pub struct RssWatch {
    max: Arc<AtomicU64>,
    samples: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssWatch {
    /// Starts sampling process `pid` every `every` (at least 1 ms).
    pub fn watch(pid: u32, every: Duration) -> RssWatch {
        let every = every.max(Duration::from_millis(1));
        let max = Arc::new(AtomicU64::new(0));
        let samples = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (max, samples, stop) = (max.clone(), samples.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(bytes) = rss(pid) {
                        max.fetch_max(bytes, Ordering::Relaxed);
                        samples.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(every);
                }
            })
        };
        RssWatch {
            max,
            samples,
            stop,
            thread: Some(thread),
        }
    }

    /// The highest resident set seen so far (bytes; 0 before a sample).
    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }

    /// Samples taken so far.
    pub fn samples(&self) -> u64 {
        self.samples.load(Ordering::Relaxed)
    }
}

impl Drop for RssWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_is_read_in_bytes_and_its_absence_is_none() {
        let status = "Name:\tx\nVmPeak:\t  900 kB\nVmRSS:\t  1234 kB\nThreads: 3\n";
        assert_eq!(vm_rss(status), Some(1234 * 1024));
        assert_eq!(vm_rss("Name:\tx\n"), None);
        assert_eq!(vm_rss("VmRSS:\tlots kB\n"), None);
    }

    #[test]
    fn this_process_has_a_resident_set_and_a_watch_samples_it() {
        let me = std::process::id();
        assert!(rss(me).is_some_and(|b| b > 0));
        let w = RssWatch::watch(me, Duration::from_millis(5));
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while w.samples() < 2 && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(w.samples() >= 2 && w.max() > 0, "{w:?}");
    }
}
