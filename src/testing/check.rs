//! Running a property: how many cases, how long to shrink, which seed, and how a
//! failure is reported.

use std::collections::hash_map::RandomState;
use std::fmt::{self, Debug, Display};
use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

/// How many shrinking steps a failure gets unless `PROPTEST_MAX_SHRINK_ITERS`
/// says otherwise: each step runs a dataflow, so proptest's unbounded default
/// could take minutes.
const MAX_SHRINK_ITERS: u32 = 64;

/// The number of cases to run: `PROPTEST_CASES` if set, else `default`.
///
/// ```
/// // Unless PROPTEST_CASES overrides it:
/// # if std::env::var("PROPTEST_CASES").is_err() {
/// assert_eq!(rtflow::testing::cases(16), 16);
/// # }
/// ```
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default)
}

/// A property that does not hold: the smallest input proptest shrank the failure
/// to, why it fails, and the seed that generates the same cases again.
#[derive(Debug, Clone)]
pub struct Failure<V> {
    /// The property's name.
    pub name: String,
    /// The minimal failing input.
    pub minimal_input: V,
    /// The assertion or error that failed on it.
    pub reason: String,
    /// `PROPTEST_RNG_SEED=<seed>` (with the same `PROPTEST_CASES`) reproduces it.
    pub seed: u64,
    /// How many cases the run was to try.
    pub cases: u32,
}

impl<V: Debug> Display for Failure<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "property '{}' failed: {}\nminimal failing input: {:#?}\nreproduce with \
             PROPTEST_RNG_SEED={} PROPTEST_CASES={}",
            self.name, self.reason, self.minimal_input, self.seed, self.cases
        )
    }
}

/// Runs `test` on [`cases`]`(default_cases)` values of `strategy`; on failure,
/// shrinks the input and returns the [`Failure`].
///
/// The seed is `PROPTEST_RNG_SEED` if set, else a fresh random one; other
/// `PROPTEST_*` variables (`PROPTEST_MAX_SHRINK_ITERS`, `PROPTEST_VERBOSE`, ...)
/// apply as in proptest. Failures are not persisted to regression files: the seed
/// in the report replays the run.
///
/// ```
/// use proptest::prelude::*;
/// use rtflow::testing::try_check;
///
/// let failure = try_check("small", 64, 0u32..1000, |n| {
///     prop_assert!(n < 10, "{n} is not small");
///     Ok(())
/// })
/// .unwrap_err();
/// assert_eq!(failure.minimal_input, 10);
/// assert!(failure.to_string().contains("PROPTEST_RNG_SEED="));
/// ```
///
/// # Panics
///
/// If proptest gives up on the property (too many rejected inputs).
pub fn try_check<S>(
    name: &str,
    default_cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> Result<(), Failure<S::Value>>
where
    S: Strategy,
    S::Value: Debug,
{
    let mut config = Config {
        cases: cases(default_cases),
        failure_persistence: None,
        ..Config::default()
    };
    if std::env::var_os("PROPTEST_MAX_SHRINK_ITERS").is_none() {
        config.max_shrink_iters = MAX_SHRINK_ITERS;
    }
    let seed = match config.rng_seed {
        RngSeed::Fixed(seed) => seed,
        RngSeed::Random => random_seed(),
    };
    config.rng_seed = RngSeed::Fixed(seed);
    let cases = config.cases;
    match TestRunner::new(config).run(&strategy, test) {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, minimal_input)) => Err(Failure {
            name: name.to_owned(),
            minimal_input,
            reason: reason.to_string(),
            seed,
            cases,
        }),
        Err(TestError::Abort(reason)) => {
            panic!("property '{name}' gave up (seed {seed}): {reason}")
        }
    }
}

/// Like [`try_check`], but panics with the failure's report: for `#[test]`s.
///
/// ```
/// use rtflow::testing::check;
///
/// check("addition commutes", 32, (0u32..100, 0u32..100), |(a, b)| {
///     proptest::prop_assert_eq!(a + b, b + a);
///     Ok(())
/// });
/// ```
pub fn check<S>(
    name: &str,
    default_cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug,
{
    if let Err(failure) = try_check(name, default_cases, strategy, test) {
        panic!("{failure}");
    }
}

/// A seed that differs between runs.
fn random_seed() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hasher.write_u128(now);
    hasher.finish()
}
