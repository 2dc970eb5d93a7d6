// Job statuses as the API reports them (design.md §2): the one place the dashboard names them. app.css styles a
// badge per status (.badge-<status>).

export const VALIDATING_FILES = "validating_files";
export const QUEUED = "queued";
export const RUNNING = "running";
export const PAUSED = "paused";
export const SUCCEEDED = "succeeded";
export const FAILED = "failed";
export const CANCELLED = "cancelled";

/** In a job's usual order: the status filter lists them so. */
export const STATUSES = [VALIDATING_FILES, QUEUED, RUNNING, PAUSED, SUCCEEDED, FAILED, CANCELLED];
/** A job in one of these never changes again: polling stops and cancel is disabled. */
export const TERMINAL = new Set([SUCCEEDED, FAILED, CANCELLED]);
/** The statuses the API accepts a pause request in. */
export const PAUSABLE = new Set([VALIDATING_FILES, QUEUED, RUNNING]);

export const statusLabel = (status) => status.replace("_", " ");
