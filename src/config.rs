//! Run files: `--config FILE.toml` holds a run's training options, `--print-config` writes the
//! resolved ones as such a file, and every runs.jsonl record keeps them (`config`), so that a
//! run can be repeated from its file or its record.
//!
//! A file is read through clap's own definitions of the options: each key is an option's long
//! name with `_` for `-` (sections only group; a key names one option whichever section holds
//! it), turned into that option's command-line text and parsed by clap like the command line.
//! So a new option is in run files with nothing to add here, and a file's value is checked as
//! the same flag's would be. Precedence: command line > file > `--preset` > built-in default.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, ArgMatches, Args, Command};

use crate::train::options::TrainArgs;

/// The section of a run file that holds the options of each help heading (torchtitan-style
/// `[data]`, `[model]`, ...). An option without a heading goes to `[run]`.
const SECTIONS: &[(&str, &str)] = &[
    ("Run", "run"),
    ("Data", "data"),
    ("Model and optimizer", "model"),
    ("Exchange", "exchange"),
    ("Horovod", "horovod"),
    ("Parameter server", "ps"),
    ("Pipeline", "pipeline"),
    ("Sharding and tensor parallelism", "sharding"),
    ("Checkpoints and faults", "checkpoint"),
    ("Output", "output"),
];

/// Options that are about reading or printing run files, not about the run: never in one.
const NOT_IN_FILES: &[&str] = &["config", "print_config"];

/// Renamed options whose old name still works but warns (once, before anything starts): the
/// old name, the new one, and why it changed.
const DEPRECATED: &[(&str, &str, &str)] = &[(
    "warmup-steps",
    "skip-steps",
    "it counts the steps left out of the throughput figures; the learning-rate warm-up is --warmup-epochs",
)];

/// The warnings for the deprecated names a command line uses (up to a `--`).
pub fn deprecated_names(argv: &[OsString]) -> Vec<String> {
    let mut warnings = Vec::new();
    for arg in argv.iter().skip(1).map(|a| a.to_string_lossy()).take_while(|a| a != "--") {
        for (old, new, why) in DEPRECATED {
            let flag = format!("--{old}");
            if arg == flag.as_str() || arg.starts_with(&format!("{flag}=")) {
                warnings.push(format!("{flag} is deprecated: use --{new} ({why})"));
            }
        }
    }
    warnings
}

/// Where the run's options came from, beside the parsed [`TrainArgs`]: the resolved table (what
/// `--print-config` prints and a record holds) and the options that a run file set.
#[derive(Clone, Debug, Default)]
pub struct RunConfig {
    /// The resolved options by section, as a run file holds them.
    pub table: toml::Table,
    /// The run file read, if any, and the long names of the options it set (an error about one
    /// of them names the file).
    pub file: Option<(PathBuf, BTreeSet<String>)>,
    /// Deprecated names the file used (one warning each).
    pub warnings: Vec<String>,
}

impl RunConfig {
    /// The table as TOML text that `--config` reads back.
    pub fn to_toml(&self) -> String {
        toml::to_string(&self.table).expect("a table of strings, numbers, booleans and arrays serializes")
    }

    /// The table as JSON, for runs.jsonl.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.table).expect("a TOML table of plain values is JSON")
    }

    /// Sets option `long` (its long name) to `value` in its section, or removes it (None): a
    /// study's point changes a few options of the study's.
    pub fn set(&mut self, long: &str, value: Option<toml::Value>) {
        let command = train_command();
        let Some(arg) = command.get_arguments().find(|a| a.get_long() == Some(long)) else {
            debug_assert!(false, "--{long} is not a training option");
            return;
        };
        let section = section_of(arg);
        let key = key_of(long);
        let table = self.table.entry(section).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(table) = table {
            match value {
                Some(v) => drop(table.insert(key, v)),
                None => drop(table.remove(&key)),
            }
        }
    }

    /// `message` (an error about the run's options) with the run file named where it is about
    /// an option that the file set and the command line did not: "the key that a layout cannot
    /// use is refused, naming the key and the file".
    pub fn attribute(&self, message: &str) -> String {
        let Some((path, longs)) = &self.file else { return message.to_string() };
        // The flag the message is about: the first one it names.
        let named = message.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')).find(|w| w.starts_with("--") && w.len() > 2);
        match named.map(|flag| &flag[2..]) {
            Some(long) if longs.contains(long) => format!("{message} (key `{}` of {})", key_of(long), path.display()),
            _ => message.to_string(),
        }
    }
}

/// The training options alone, as clap defines them (the command line's and every file's).
pub fn train_command() -> Command {
    TrainArgs::augment_args(Command::new("hpc-train").no_binary_name(true))
}

/// An option's key in a run file: its long name with `_` for `-`.
fn key_of(long: &str) -> String {
    long.replace('-', "_")
}

fn section_of(arg: &Arg) -> String {
    let heading = arg.get_help_heading().unwrap_or("Run");
    SECTIONS.iter().find(|(h, _)| *h == heading).map_or_else(|| key_of(&heading.to_lowercase().replace(' ', "-")), |(_, s)| s.to_string())
}

/// What a run file and a preset add to a command line: the extra arguments, and which options
/// came from where.
pub struct Additions {
    /// `--long=value` (or `--long` for a switch) for every option the file or preset sets and
    /// the command line does not.
    pub args: Vec<OsString>,
    /// Ids of the options a preset set (not "given": an option a preset sets is a default).
    pub preset_ids: Vec<String>,
    /// The run file and the long names of the options it set.
    pub file: Option<(PathBuf, BTreeSet<String>)>,
    /// Deprecated keys the file used.
    pub warnings: Vec<String>,
}

/// The arguments that `--config` (when `matches` has one) and `--preset` add to a command line
/// whose training options parsed into `matches`: each option the command line did not give,
/// from the file, else from the preset; an option that conflicts with one given on the command
/// line (e.g. the file's --measured-steps against the command line's --steps) is left out, the
/// command line winning. Refuses, in one line naming the file and the key, a file that does not
/// read, an unknown key, a value of the wrong type, and two keys of the file that conflict.
pub fn additions(matches: &ArgMatches) -> Result<Additions, String> {
    use crate::train::options::Preset;
    let command = train_command();
    let on_command_line = |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    let given: Vec<String> = command.get_arguments().map(|a| a.get_id().as_str().to_string()).filter(|id| on_command_line(id)).collect();
    let conflicts = |a: &Arg, b: &Arg| command.get_arg_conflicts_with(a).iter().any(|c| c.get_id() == b.get_id()) || command.get_arg_conflicts_with(b).iter().any(|c| c.get_id() == a.get_id());
    let by_id = |id: &str| command.get_arguments().find(|a| a.get_id() == id).expect("an id of the command");

    // The file's options: (id, the command-line arguments that set it).
    let mut from_file: Vec<(String, Vec<OsString>)> = Vec::new();
    let mut warnings = Vec::new();
    let path = matches.get_one::<PathBuf>("config").cloned();
    if let Some(path) = &path {
        let text = std::fs::read_to_string(path).map_err(|e| format!("--config {}: {e}", path.display()))?;
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let line = e.span().map_or(0, |s| text[..s.start.min(text.len())].lines().count().max(1));
            format!("--config {}: not TOML (line {line}): {}", path.display(), e.message().trim().replace('\n', "; "))
        })?;
        for (key, value, arg) in keys(&command, path, &table)? {
            if let Some((_, new, why)) = DEPRECATED.iter().find(|(old, _, _)| key_of(old) == key) {
                warnings.push(format!("{}: key `{key}` is deprecated: use `{}` ({why})", path.display(), key_of(new)));
            }
            from_file.push((arg.get_id().as_str().to_string(), argument_text(&command, path, &key, arg, &value)?));
        }
    }
    // The preset: named on the command line, else in the file.
    let preset = match matches.get_one::<Preset>("preset") {
        Some(p) => Some(*p),
        None => from_file.iter().find(|(id, _)| id == "preset").and_then(|(_, args)| {
            let text = args[0].to_string_lossy().into_owned();
            <Preset as clap::ValueEnum>::from_str(text.split_once('=').map_or("", |(_, v)| v), false).ok()
        }),
    };
    let preset_options: &[(&str, &str)] = preset.map_or(&[], |p| p.options());
    let preset_sets = |arg: &Arg| preset_options.iter().any(|(long, _)| arg.get_long() == Some(long));

    // A file's value that is the option's default changes nothing (and is not "given", so
    // that a file written by --print-config, which holds every option, reads back as the run
    // it came from); it is kept where it overrides the preset's.
    let file_ids: Vec<&str> = from_file.iter().map(|(id, _)| id.as_str()).collect();
    let effective: Vec<&(String, Vec<OsString>)> = from_file.iter().filter(|(id, args)| preset_sets(by_id(id)) || !is_default(by_id(id), args)).collect();
    if let Some(path) = &path {
        // Two keys of the file that cannot go together are the file's mistake, not a choice
        // (unless the command line replaces one of them).
        for (i, (a, _)) in effective.iter().enumerate() {
            for (b, _) in &effective[i + 1..] {
                let (a, b) = (by_id(a), by_id(b));
                if conflicts(a, b) && !given.iter().any(|g| conflicts(by_id(g), a) || conflicts(by_id(g), b) || g == a.get_id() || g == b.get_id()) {
                    return Err(format!(
                        "--config {}: keys `{}` and `{}` cannot be used together",
                        path.display(),
                        key_of(a.get_long().unwrap_or_default()),
                        key_of(b.get_long().unwrap_or_default())
                    ));
                }
            }
        }
    }

    let mut args = Vec::new();
    let mut taken: Vec<String> = given.clone();
    let mut file_longs = BTreeSet::new();
    for (id, file_args) in effective {
        let arg = by_id(id);
        if taken.contains(id) || taken.iter().any(|t| conflicts(by_id(t), arg)) {
            continue;
        }
        args.extend(file_args.iter().cloned());
        file_longs.insert(arg.get_long().expect("found by its long name").to_string());
        taken.push(id.clone());
    }
    let mut preset_ids = Vec::new();
    for &(long, value) in preset_options {
        let arg = command.get_arguments().find(|a| a.get_long() == Some(long)).expect("tests/every_preset_names_options_of_the_command_line");
        let id = arg.get_id().as_str().to_string();
        // An option the command line or the file set wins; so does one set there that cannot
        // go with it (a length given replaces the preset's --measured-steps).
        if taken.contains(&id) || file_ids.contains(&id.as_str()) || taken.iter().any(|t| conflicts(by_id(t), arg)) {
            continue;
        }
        match arg.get_action() {
            ArgAction::SetTrue if value == "true" => args.push(format!("--{long}").into()),
            ArgAction::SetTrue => {}
            _ => args.push(format!("--{long}={value}").into()),
        }
        preset_ids.push(id);
    }
    Ok(Additions { args, preset_ids, file: path.map(|p| (p, file_longs)), warnings })
}

/// Whether the arguments `args` (from [`argument_text`]) set option `arg` to its default.
fn is_default(arg: &Arg, args: &[OsString]) -> bool {
    if matches!(arg.get_action(), ArgAction::SetTrue) {
        return args.is_empty();
    }
    let [one] = args else { return false };
    let text = one.to_string_lossy();
    let value = text.split_once('=').map_or("", |(_, v)| v);
    let defaults: Vec<String> = arg.get_default_values().iter().map(|d| d.to_string_lossy().into_owned()).collect();
    let delimiter = arg.get_value_delimiter().map(String::from).unwrap_or_default();
    let default = defaults.join(&delimiter);
    if defaults.is_empty() {
        return false;
    }
    value == default || matches!((value.parse::<f64>(), default.parse::<f64>()), (Ok(a), Ok(b)) if a == b)
}

/// The keys of a file's table with their values and options, sections flattened; refuses an
/// unknown key, a key given twice, and an option no run file holds.
fn keys<'c>(command: &'c Command, path: &Path, table: &toml::Table) -> Result<Vec<(String, toml::Value, &'c Arg)>, String> {
    let known = |key: &str| {
        let long = key.replace('_', "-");
        command.get_arguments().find(|a| a.get_long() == Some(long.as_str()) || a.get_all_aliases().is_some_and(|all| all.contains(&long.as_str())))
    };
    let mut found = Vec::new();
    let mut seen = BTreeSet::new();
    let mut visit = |key: &str, value: &toml::Value, section: Option<&str>| -> Result<(), String> {
        let place = section.map_or(String::new(), |s| format!(" in [{s}]"));
        let arg = known(key).ok_or_else(|| format!("--config {}: unknown key `{key}`{place} (keys are the options' long names with _ for -, as --print-config writes them)", path.display()))?;
        if NOT_IN_FILES.contains(&arg.get_id().as_str()) {
            return Err(format!("--config {}: key `{key}`: a run file cannot name another run file or print one", path.display()));
        }
        if !seen.insert(arg.get_id().as_str().to_string()) {
            return Err(format!("--config {}: key `{key}` sets --{} a second time", path.display(), arg.get_long().unwrap_or_default()));
        }
        found.push((key.to_string(), value.clone(), arg));
        Ok(())
    };
    for (name, value) in table {
        match value {
            toml::Value::Table(section) => {
                for (key, value) in section {
                    if let toml::Value::Table(_) = value {
                        return Err(format!("--config {}: [{name}.{key}]: sections are one level deep", path.display()));
                    }
                    visit(key, value, Some(name))?;
                }
            }
            _ => visit(name, value, None)?,
        }
    }
    Ok(found)
}

/// The command-line arguments that set option `arg` to a file's `value`, checked by clap's own
/// parser of that option; a value of the wrong type is refused naming the key and the file.
fn argument_text(command: &Command, path: &Path, key: &str, arg: &Arg, value: &toml::Value) -> Result<Vec<OsString>, String> {
    let long = arg.get_long().expect("found by its long name");
    let wrong = |expected: &str| format!("--config {}: key `{key}` = {value}: expected {expected}", path.display());
    let scalar = |v: &toml::Value| match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(float_text(*f)),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        _ => Err(wrong("a string, number or boolean")),
    };
    let args: Vec<OsString> = match (arg.get_action(), value) {
        (ArgAction::SetTrue, toml::Value::Boolean(true)) => vec![format!("--{long}").into()],
        (ArgAction::SetTrue, toml::Value::Boolean(false)) => vec![],
        (ArgAction::SetTrue, _) => return Err(wrong("true or false")),
        (_, toml::Value::Array(items)) => {
            let Some(delimiter) = arg.get_value_delimiter() else { return Err(wrong("one value, not a list")) };
            let items = items.iter().map(scalar).collect::<Result<Vec<_>, _>>()?;
            vec![format!("--{long}={}", items.join(&delimiter.to_string())).into()]
        }
        (_, v) => vec![format!("--{long}={}", scalar(v)?).into()],
    };
    // The value checked alone, by the option's own parser (ranges, enums, numbers).
    let mut alone = command.clone();
    if let Err(e) = alone.try_get_matches_from_mut(&args) {
        let rendered = e.to_string();
        let detail = rendered.lines().next().unwrap_or_default().trim_start_matches("error: ");
        return Err(format!("--config {}: key `{key}` = {value}: {detail}", path.display()));
    }
    Ok(args)
}

/// A float as text that parses back to the same number (1e-8, not 0.00000001's rounding).
fn float_text(f: f64) -> String {
    format!("{f:?}")
}

/// The resolved training options of a parsed command line (`matches` of the training options,
/// after [`additions`]), by section, as a run file holds them: every option with a value (a
/// default included), so that the file says everything the run used; options without a value
/// (unset `Option`s) are left out, which a file reads back as unset. Hidden options (test
/// hooks) only where set.
pub fn resolved(matches: &ArgMatches) -> RunConfig {
    let command = train_command();
    let mut table = toml::Table::new();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        if NOT_IN_FILES.contains(&id) || arg.get_long().is_none() {
            continue;
        }
        let source = matches.value_source(id);
        if arg.is_hide_set() && source != Some(clap::parser::ValueSource::CommandLine) {
            continue;
        }
        let value = match arg.get_action() {
            ArgAction::SetTrue => toml::Value::Boolean(matches.get_flag(id)),
            _ => {
                let Some(raw) = matches.get_raw(id) else { continue };
                let values: Vec<toml::Value> = raw.map(|v| typed(&v.to_string_lossy())).collect();
                match (values.len(), arg.get_value_delimiter()) {
                    (1, None) => values.into_iter().next().expect("one"),
                    _ => toml::Value::Array(values),
                }
            }
        };
        let section = table.entry(section_of(arg)).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(section) = section {
            section.insert(key_of(arg.get_long().expect("checked")), value);
        }
    }
    RunConfig { table, file: None, warnings: Vec::new() }
}

/// A command-line value as the TOML value a person would write: a number or a boolean where it
/// is one, else a string (every option reads any of them back through its own parser).
fn typed(text: &str) -> toml::Value {
    if let Ok(i) = text.parse::<i64>() {
        return toml::Value::Integer(i);
    }
    if text.chars().any(|c| c.is_ascii_digit()) {
        if let Ok(f) = text.parse::<f64>() {
            if f.is_finite() {
                return toml::Value::Float(f);
            }
        }
    }
    match text {
        "true" => toml::Value::Boolean(true),
        "false" => toml::Value::Boolean(false),
        _ => toml::Value::String(text.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;

    /// A file in a folder of this test process's own, removed with it.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("hpc-train-config-{}-{name}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn file(&self, name: &str, text: &str) -> String {
            let path = self.0.join(name);
            std::fs::write(&path, text).unwrap();
            path.to_str().unwrap().to_string()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn parse(args: &[&str]) -> Result<TrainArgs, String> {
        let cli = Cli::parse_from_noting_given([&["hpc-train"], args].concat()).map_err(|e| e.to_string())?;
        Ok(cli.train)
    }

    /// The options themselves, without what notes where they came from.
    fn options(a: &TrainArgs) -> String {
        format!("{:?}", TrainArgs { given: Default::default(), run_config: Default::default(), config: None, print_config: false, ..a.clone() })
    }

    const FLAGS: &[&str] = &["--model", "tiny", "--data", "synthetic:3x16x16:10:256", "--batch-size", "4", "--steps", "3", "--no-eval", "--lr", "0.1", "--seed", "7", "--bucket-mb", "0.5", "--lr-steps", "1,2"];

    const FILE: &str = r#"
[data]
data = "synthetic:3x16x16:10:256"
batch_size = 4
steps = 3
no_eval = true

[model]
model = "tiny"
lr = 0.1
lr_steps = [1, 2]

[run]
seed = 7

[exchange]
bucket_mb = 0.5
"#;

    #[test]
    fn a_file_and_the_same_flags_give_the_same_options() {
        let dir = Scratch::new("same");
        let path = dir.file("run.toml", FILE);
        let from_flags = parse(FLAGS).unwrap();
        let from_file = parse(&["--config", &path]).unwrap();
        assert_eq!(options(&from_flags), options(&from_file));
        // The file's options count as given (the layout checks apply to them), as flags do.
        for id in ["model", "batch_size", "steps", "no_eval", "lr", "seed", "bucket_mb", "lr_steps"] {
            assert!(from_file.given.has(id), "{id}");
        }
        assert_eq!(from_flags.run_config.table, from_file.run_config.table);
    }

    #[test]
    fn the_command_line_wins_over_the_file_and_the_file_over_the_preset() {
        let dir = Scratch::new("precedence");
        let path = dir.file("run.toml", "preset = \"cpu-trial\"\n[data]\nbatch_size = 8\nno_eval = false\n");
        let a = parse(&["--config", &path]).unwrap();
        // The file's batch and evaluation, the preset's model and length.
        assert_eq!((a.batch_size, a.no_eval, a.model, a.measured_steps), (8, false, crate::model::ModelKind::Tiny, Some(20)));
        assert!(!a.given.has("model"), "a preset's option is a default, not given");
        let a = parse(&["--config", &path, "--batch-size", "2", "--steps", "3"]).unwrap();
        // A length on the command line replaces the preset's --measured-steps.
        assert_eq!((a.batch_size, a.steps, a.measured_steps), (2, Some(3), None));
        // A file's length gives way to the command line's where the two cannot go together.
        let path = dir.file("length.toml", "measured_steps = 4\n");
        let a = parse(&["--config", &path, "--steps", "3"]).unwrap();
        assert_eq!((a.steps, a.measured_steps), (Some(3), None));
    }

    #[test]
    fn print_config_reads_back_as_the_same_run() {
        let dir = Scratch::new("print");
        for args in [FLAGS, &["--preset", "cpu-trial", "--strategy", "horovod", "--timeline", "t.json", "--lr-schedule", "cosine"][..], &["--zero", "3", "--fsdp-unit", "stage", "--pipeline-stages", "1"][..]] {
            let first = parse(args).unwrap();
            let text = first.run_config.to_toml();
            let path = dir.file("printed.toml", &text);
            let again = parse(&["--config", &path]).unwrap();
            assert_eq!(options(&first), options(&again), "{args:?}");
            assert_eq!(again.run_config.to_toml(), text, "{args:?}: printed again, the same file");
            // Defaults in the file are not "given" (no check refuses them); the rest is.
            assert!(!again.given.has("checkpoint_every") && !again.given.has("epochs"), "{args:?}");
        }
        // Sections named after the help headings.
        let text = parse(FLAGS).unwrap().run_config.to_toml();
        for section in ["[data]", "[model]", "[exchange]", "[run]", "[checkpoint]", "[output]", "[pipeline]", "[ps]", "[sharding]"] {
            assert!(text.contains(section), "{section} in\n{text}");
        }
    }

    /// The record's `config` (JSON in runs.jsonl) is what --config reads; older records
    /// without `config` and `argv` still load.
    #[test]
    fn a_record_holds_a_run_file_and_old_records_load() {
        let dir = Scratch::new("record");
        let first = parse(FLAGS).unwrap();
        let rerun = crate::results::Rerun { config: Some(first.run_config.to_json()), argv: vec!["hpc-train".into(), "--steps".into(), "3".into()] };
        let line = serde_json::to_string(&rerun).unwrap();
        let back: crate::results::Rerun = serde_json::from_str(&line).unwrap();
        let text = toml::to_string(&back.config.unwrap()).unwrap();
        let path = dir.file("record.toml", &text);
        assert_eq!(options(&parse(&["--config", &path]).unwrap()), options(&first));
        assert_eq!(back.argv, rerun.argv);
        let old: crate::results::Rerun = serde_json::from_str(r#"{"strategy": "ring"}"#).unwrap();
        assert_eq!(old, crate::results::Rerun::default());
    }

    #[test]
    fn a_bad_file_is_refused_in_one_line_naming_the_key_and_the_file() {
        let dir = Scratch::new("bad");
        let cases: &[(&str, &str)] = &[
            ("[data]\nbatch_sise = 4\n", "unknown key `batch_sise` in [data]"),
            ("[data]\nbatch_size = \"four\"\n", "key `batch_size` = \"four\": invalid value 'four' for '--batch-size"),
            ("[data]\nbatch_size = 0\n", "key `batch_size` = 0"),
            ("no_eval = 1\n", "key `no_eval` = 1: expected true or false"),
            ("model = \"resnet-49\"\n", "key `model` = \"resnet-49\": invalid value"),
            ("seed = [1, 2]\n", "key `seed` = [1, 2]: expected one value, not a list"),
            ("steps = 3\nmeasured_steps = 4\n", "keys `measured_steps` and `steps` cannot be used together"),
            ("config = \"other.toml\"\n", "key `config`: a run file cannot name another run file"),
            ("[data.more]\nsteps = 3\n", "[data.more]: sections are one level deep"),
            ("steps = 3\n[data]\nsteps = 4\n", "key `steps` sets --steps a second time"),
            ("steps = \n", "not TOML"),
        ];
        for (text, expected) in cases {
            let path = dir.file("bad.toml", text);
            let err = parse(&["--config", &path]).unwrap_err();
            assert!(err.contains(&format!("--config {path}: ")) && err.contains(expected), "{text:?}: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        }
        assert!(parse(&["--config", "/nonexistent/run.toml"]).unwrap_err().contains("--config /nonexistent/run.toml: "));
    }

    /// A layout's refusal of an option (the checks run after parsing, from plan/compat.rs and
    /// the strategies' tables) names the key and the file when the file set it.
    #[test]
    fn a_refusal_of_a_files_option_names_the_key_and_the_file() {
        let dir = Scratch::new("refusal");
        let path = dir.file("run.toml", "[horovod]\ntimeline = \"t.json\"\n");
        let a = parse(&["--config", &path]).unwrap();
        let err = a.check_unused_options(&[a.strategy]).unwrap_err().to_string();
        let said = a.run_config.attribute(&err);
        assert!(said.starts_with("--timeline is an option of --strategy horovod") && said.ends_with(&format!("(key `timeline` of {path})")), "{said}");
        // Given on the command line, the message is the flag's, as before.
        let a = parse(&["--config", &path, "--timeline", "u.json"]).unwrap();
        let err = a.check_unused_options(&[a.strategy]).unwrap_err().to_string();
        assert_eq!(a.run_config.attribute(&err), err);
    }

    /// jobs/configs/ holds the presets as run files (and ViT-B/16 with tensor parallelism): each
    /// reads, passes the option checks, and is the run its flags make.
    #[test]
    fn the_golden_run_files_are_the_runs_they_name() {
        let golden: &[(&str, &[&str])] = &[
            ("resnet50-throughput", &["--preset", "resnet50-throughput"]),
            ("cpu-study", &["--preset", "cpu-trial", "--device", "cpu"]),
            ("vit-b16-tp", &["--model", "vit-b16", "--data", "synthetic:3x224x224:1000", "--tensor-parallel", "4", "--batch-size", "32", "--skip-steps", "10", "--measured-steps", "50", "--no-eval", "--precision", "bf16"]),
        ];
        for (name, flags) in golden {
            let path = format!("{}/jobs/configs/{name}.toml", env!("CARGO_MANIFEST_DIR"));
            let from_file = parse(&["--config", &path]).unwrap_or_else(|e| panic!("{name}: {e}"));
            from_file.check_unused_options(&[from_file.strategy]).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(options(&from_file), options(&parse(flags).unwrap()), "{name}");
        }
    }

    /// `study --config` gives the file's options to every point, the study's command line winning.
    #[test]
    fn study_takes_the_run_file() {
        let dir = Scratch::new("study");
        let path = dir.file("run.toml", FILE);
        let cli = Cli::parse_from_noting_given(["hpc-train", "study", "--config", &path, "--ranks", "1,2", "--batch-size", "2", "--study", "s1"]).unwrap();
        let Some(crate::cli::Command::Study(study)) = cli.command else { panic!("a study") };
        let a = study.train;
        assert_eq!((study.ranks.as_str(), a.study_tag.as_deref(), a.batch_size), ("1,2", Some("s1"), 2));
        assert_eq!(options(&TrainArgs { batch_size: 4, study_tag: None, ..a }), options(&parse(FLAGS).unwrap()));
        // A study's own option is not a run file's.
        let path = dir.file("study.toml", "ranks = \"1,2\"\n");
        let err = Cli::parse_from_noting_given(["hpc-train", "study", "--config", &path]).unwrap_err().to_string();
        assert!(err.contains("unknown key `ranks`"), "{err}");
    }

    #[test]
    fn old_names_work_and_the_deprecated_one_warns() {
        let a = parse(&["--warmup-steps", "3", "--study-tag", "t", "--bucket-mb", "2", "--segment-kb", "8", "--strategy", "horovod", "--fusion-threshold-mb", "4", "--timeline-filename", "t.json", "--hierarchical-allreduce"]).unwrap();
        assert_eq!((a.warmup_steps, a.study_tag.as_deref(), a.bucket_mb, a.segment_kb), (3, Some("t"), 2.0, 8));
        assert_eq!((a.horovod.fusion_threshold_mb, a.horovod.timeline.as_deref(), a.horovod.hierarchical), (Some(4.0), Some(Path::new("t.json")), Some(true)));
        let argv: Vec<OsString> = ["hpc-train", "--warmup-steps=3", "--skip-steps", "2", "--bucket-mb", "1"].iter().map(OsString::from).collect();
        let warnings = deprecated_names(&argv);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("--warmup-steps is deprecated: use --skip-steps"), "{warnings:?}");
        let dir = Scratch::new("deprecated");
        let path = dir.file("old.toml", "warmup_steps = 3\n");
        let a = parse(&["--config", &path]).unwrap();
        assert_eq!(a.warmup_steps, 3);
        assert!(a.run_config.warnings[0].contains("key `warmup_steps` is deprecated: use `skip_steps`"), "{:?}", a.run_config.warnings);
    }
}
