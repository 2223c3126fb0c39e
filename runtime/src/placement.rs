//! Which CPUs a query's threads run on ([`QueryConfig::cpu_affinity`]).
//!
//! Linux threads inherit the affinity of the thread that creates them, so the
//! coordinator pins its own thread before it starts the actors, and every thread
//! of the query (actors, compaction) follows.
//!
//! [`QueryConfig::cpu_affinity`]: crate::config::QueryConfig::cpu_affinity

use crate::error::{Result, RtflowError};

/// Checks that `cpus` names at least one CPU and only CPUs this process may use.
pub(crate) fn check(cpus: &[usize]) -> Result<()> {
    if cpus.is_empty() {
        return Err(RtflowError::InvalidConfiguration(
            "cpu_affinity names no CPU; leave it unset to let the OS place the \
             query's threads"
                .into(),
        ));
    }
    let allowed = allowed_cpus()?;
    match cpus.iter().find(|cpu| !allowed.contains(cpu)) {
        Some(cpu) => Err(RtflowError::InvalidConfiguration(format!(
            "cpu_affinity names CPU {cpu}, but this process may only run on CPUs {allowed:?}"
        ))),
        None => Ok(()),
    }
}

#[cfg(target_os = "linux")]
fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity writes at
    // most `size_of::<cpu_set_t>()` bytes into it; `pid = 0` is this thread.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(RtflowError::InvalidConfiguration(format!(
                "cannot read this process's CPU affinity: {}",
                std::io::Error::last_os_error()
            )));
        }
        set
    };
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE, the set's capacity.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

#[cfg(not(target_os = "linux"))]
fn allowed_cpus() -> Result<Vec<usize>> {
    Err(RtflowError::InvalidConfiguration(
        "cpu_affinity is supported on Linux only".into(),
    ))
}

/// Restricts the calling thread, and the threads it starts from now on, to `cpus`
/// (checked by [`check`] beforehand).
#[cfg(target_os = "linux")]
pub(crate) fn pin_current_thread(cpus: &[usize]) -> Result<()> {
    // SAFETY: as in `allowed_cpus`; every `cpu` passed `check`, so it is below
    // CPU_SETSIZE.
    let pinned = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if pinned != 0 {
        return Err(RtflowError::InvalidConfiguration(format!(
            "cannot pin the query's threads to CPUs {cpus:?}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn pin_current_thread(_cpus: &[usize]) -> Result<()> {
    allowed_cpus().map(drop)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn names_the_cpu_the_process_may_not_use() {
        let allowed = allowed_cpus().unwrap();
        assert!(!allowed.is_empty());
        assert!(check(&allowed).is_ok());
        let outside = allowed.last().unwrap() + 1;
        let error = check(&[allowed[0], outside]).unwrap_err().to_string();
        assert!(error.contains(&format!("CPU {outside}")), "{error}");
        assert!(check(&[]).unwrap_err().to_string().contains("names no CPU"));
    }
}
